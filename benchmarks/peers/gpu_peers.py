"""Time the peer systems a user would pick instead of DSpark on an NVIDIA GPU: ONNX Runtime GenAI (its model
builder's fp16 CUDA model, with and without CUDA graphs) and Hugging Face transformers (``generate``, dynamic and
static cache), on a Qwen2.5-1.5B-architecture model with random weights, greedy, at fixed batch sizes / prompt
length / new tokens. Run by ``benchmarks.gpu.check_cuda``'s peers phase; each subcommand's docstring says what it
does and the output JSON is ``gpu_peers_report.Report``'s.

    python -m benchmarks.peers.gpu_peers make-model OUT [--tiny] [--device cuda|cpu]
    python -m benchmarks.peers.gpu_peers genai HF_FOLDER WORK --out genai.json [--ep cuda|cpu]
    python -m benchmarks.peers.gpu_peers hf HF_FOLDER --out hf.json [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import sys

from benchmarks.peers.gpu_peers_genai import cmd_genai
from benchmarks.peers.gpu_peers_hf import cmd_hf
from benchmarks.peers.gpu_peers_model import cmd_make_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-model", help="write a random-weight Qwen2.5-1.5B-architecture HF folder")
    m.add_argument("out")
    m.add_argument("--tiny", action="store_true", help="tiny config of the same architecture (CPU tests)")
    m.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    m.add_argument("--seed", type=int, default=0)

    def timing(p):
        p.add_argument("--out", required=True, help="result JSON (rewritten after every configuration)")
        p.add_argument("--batches", default="1,8,32")
        p.add_argument("--prompt-len", type=int, default=128)
        p.add_argument("--new-tokens", type=int, default=128)
        p.add_argument("--repeats", type=int, default=3)
        p.add_argument("--seed", type=int, default=0, help="seed of the prompt ids")
        p.add_argument("--deadline-s", type=float, default=None,
                       help="wall seconds from the script's start; later configurations are skipped")

    g = sub.add_parser("genai", help="onnxruntime-genai: model builder + Generator timing")
    g.add_argument("hf")
    g.add_argument("work", help="folder for the builder's output and cache")
    g.add_argument("--ep", choices=["cuda", "cpu"], default="cuda")
    g.add_argument("--precision", choices=["fp16", "bf16", "fp32", "int4"], default=None,
                   help="default fp16 for cuda, fp32 for cpu")
    g.add_argument("--cuda-graph", choices=["both", "on", "off"], default="both")
    g.add_argument("--rebuild", action="store_true", help="run the builder even if its output is there")
    g.add_argument("--build-only", action="store_true", help="run (or reuse) the builder, time nothing")
    g.add_argument("--no-preload", action="store_true",
                   help="do not call onnxruntime.preload_dlls() before loading the CUDA model")
    timing(g)

    h = sub.add_parser("hf", help="transformers generate timing")
    h.add_argument("hf")
    h.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    h.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    h.add_argument("--attn", default="sdpa", help="attn_implementation")
    h.add_argument("--caches", default="dynamic,static", help="comma list of dynamic / static")
    timing(h)

    a = ap.parse_args(argv)
    if a.cmd == "make-model":
        return cmd_make_model(a)
    if a.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (the decode part starts after the first token)")
    if a.cmd == "genai":
        return cmd_genai(a)
    return cmd_hf(a)


if __name__ == "__main__":
    sys.exit(main())
