"""What the CUDA GPU check (``benchmarks.gpu.check_cuda``) runs on, prepared on any machine (by ``bash
scripts/gpu_check.sh --prepare-cuda``; writes ``.carry/gpu-cuda/``, which git ignores): ``tiny-fp32/``, ``tiny-fp16/``
(the tiny test pair as fp32 engines with a device graph of the target, fp32 / fp16), ``tiny-fp8/`` (its FP8 QDQ
graph) and ``big/``: a Qwen2.5-1.5B-architecture target with random weights as an fp16 device graph, stripped of its
3.1 GB weight file (``weights.json`` lists every external tensor, ``small.npz`` keeps those up to 64 KiB); the check
regenerates the large ones with seeded random values on the GPU machine, since a device call carries 64 MiB.

    python -m benchmarks.gpu.prepare_cuda [--out .carry/gpu-cuda] [--skip-big]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.evalsets import ROOT
from benchmarks.peers.gpu_peers_model import QWEN25_1P5B  # the peers' model has the same architecture

BIG_PROFILE = dict(max_batch=32, decode_q=8, prefill_chunk=64, capacity=1024, min_bucket=256)
TINY_PROFILE = dict(max_batch=4, decode_q=5, prefill_chunk=16, capacity=128, min_bucket=32)
SMALL_BYTES = 1 << 16  # external tensors up to this size are kept as they are (norm weights, biases)


def tiny_engines(out: Path) -> None:
    from tests.tiny_models import make_pair

    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_export.graphs.device import build_cuda
    from dspark_runtime.backends.trt.profiles import ProfileSettings

    with tempfile.TemporaryDirectory() as tmp:
        t, d = make_pair(Path(tmp))
        base = out / "tiny-fp32"
        build_engine(Recipe(name="tiny", target=str(t), draft=str(d), draft_length=4, kv_layout="growing"), base,
                     isolate=False, log=lambda *a: None)
        shutil.copytree(base, out / "tiny-fp16")
        build_cuda(base, ProfileSettings(**TINY_PROFILE), half=None, isolate=False)
        build_cuda(out / "tiny-fp16", ProfileSettings(**TINY_PROFILE), half="fp16", isolate=False)
        build_engine(Recipe(name="tiny-fp8", target=str(t), precision="fp8", kv_layout="growing"), out / "tiny-fp8",
                     isolate=False, log=lambda *a: None, fp8_writer="stream")


def big_graph(out: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_export.graphs.device import build_cuda
    from dspark_runtime.backends.trt.profiles import ProfileSettings

    work = Path(tempfile.mkdtemp(prefix="big-", dir=out.parent))
    try:
        torch.manual_seed(0)
        hf = work / "hf"
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_1P5B)).eval()
        model.save_pretrained(hf)
        _tokenizer(hf)
        del model
        eng = work / "engine"
        build_engine(Recipe(name="qwen2.5-1.5b-arch", target=str(hf), kv_layout="growing"), eng, isolate=True)
        shutil.rmtree(hf)
        build_cuda(eng, ProfileSettings(**BIG_PROFILE), half="fp16", isolate=True)
        strip_device_graph(eng, out / "big")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def strip_device_graph(engine_dir: Path, big: Path) -> None:
    """Copy the target's device graph of ``engine_dir`` into ``big`` without its weight file: the graph, its
    manifest entry (``device_graph.json``), ``weights.json`` (every external tensor: offset, bytes, type) and
    ``small.npz`` (the tensors up to 64 KiB, as they are); benchmarks/gpu/check_cuda.py regenerates the rest."""
    import onnx

    from dspark_runtime.engine_dir.manifest import load_manifest

    e = load_manifest(engine_dir, verify=False).device_graphs["target"]
    big.mkdir(parents=True, exist_ok=True)
    proto = onnx.load(str(engine_dir / e.onnx), load_external_data=False)
    tensors, small, files = [], {}, set()
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        ext = {x.key: x.value for x in t.external_data}
        files.add(ext["location"])
        off, n = int(ext.get("offset", 0)), int(ext["length"])
        if n <= SMALL_BYTES:
            with open(engine_dir / ext["location"], "rb") as f:
                f.seek(off)
                small[f"t{len(tensors)}"] = np.frombuffer(f.read(n), np.uint8)
        tensors.append({"name": t.name, "offset": off, "length": n, "data_type": int(t.data_type)})
    if len(files) != 1:
        raise SystemExit(f"{e.onnx}: weights in {sorted(files)}; expected one external data file")
    shutil.copy(engine_dir / e.onnx, big / e.onnx)
    (big / "weights.json").write_text(json.dumps({"file": files.pop(), "tensors": tensors}))
    np.savez_compressed(big / "small.npz", **small)
    (big / "device_graph.json").write_text(json.dumps(e.to_json(), indent=1))
    print(f"{big}: {len(tensors)} external tensors, {sum(t['length'] for t in tensors) / 2**30:.2f} GiB regenerated "
          f"there, graph {(big / e.onnx).stat().st_size / 2**20:.1f} MiB")


def _tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer for the random model's folder (the export reads one; no text is decoded)."""
    from tests.tiny_models import make_tokenizer

    make_tokenizer(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / ".carry" / "gpu-cuda")
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--strip", type=Path, default=None, metavar="ENGINE",
                    help="only strip ENGINE's device graph into OUT/big (e.g. a tiny engine, for --cpu-stand-in)")
    a = ap.parse_args()
    if a.strip:
        strip_device_graph(a.strip, a.out / "big")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.skip_tiny:
        tiny_engines(a.out)
    if not a.skip_big:
        big_graph(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
