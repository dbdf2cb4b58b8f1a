"""Teacher-forced target features by path, for drafter training on a CPU: the engine's own target graph (ONNX
Runtime's CPU provider: the deployed int4 arithmetic, what `dspark-export train-draft --engine` extracts with)
against the target's Hugging Face weights in torch (bf16 on the CPU's bf16 units, fp32), on the same sequences.

For each path: tokens/s of the teacher-forced pass (one call per sequence, THREADS threads), and against the engine's
graph (its features and logits as training reads them: fp16 shards): relative L2 of the features (layers --layers,
DeepSpec indexing, concatenated) over all positions, and top-1 agreement of the logits over the draft vocabulary
(torch: the final hidden state times the LM head). Sequences: the first --n answers of ANSWERS (a train-draft answers
file, .jsonl or .jsonl.gz) of --min-len..--max-len tokens.

    python -m benchmarks.feature_paths --engine engines/qwen2.5-coder-1.5b \\
        --target ~/.cache/dspark/models/qwen2.5-coder-1.5b-instruct \\
        --answers engines/drafters/data/qwen2.5-coder-1.5b-int4-answers.jsonl.gz --n 10 --json result.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def load_sequences(path: Path, n: int, min_len: int, max_len: int) -> list:
    """The first ``n`` token-id lists of the answers file ``path`` with ``min_len``..``max_len`` tokens."""
    opener = gzip.open if str(path).endswith(".gz") else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            ids = json.loads(line)["ids"]
            if min_len <= len(ids) <= max_len:
                out.append([int(t) for t in ids])
                if len(out) == n:
                    break
    return out


def engine_features(engine: Path, seqs: list, vocab: np.ndarray, threads: int) -> tuple:
    """(features fp32 [n, m*d], logits over ``vocab`` fp32 [n, V_d], seconds of the graph passes) from the engine's
    target graph."""
    from dspark_export.drafter.features import FeatureStore, extract_features_ort

    with tempfile.TemporaryDirectory() as tmp:
        sec = extract_features_ort(engine, [(np.asarray(s, np.int32), np.ones(len(s), np.uint8)) for s in seqs],
                                   Path(tmp), vocab, threads=threads, shard_tokens=1 << 30)["pass_seconds"]
        store = FeatureStore(Path(tmp))
        parts = [store.get(i) for i in range(len(store))]
        return (np.concatenate([p[2] for p in parts]).astype(np.float32),
                np.concatenate([p[3] for p in parts]).astype(np.float32), sec)


def torch_features(target: Path, seqs: list, vocab: np.ndarray, layers: list, dtype: str, threads: int) -> tuple:
    """(features fp32 [n, m*d], logits over ``vocab`` fp32 [n, V_d], seconds of the forward passes) from the
    Hugging Face weights in torch ``dtype``; model loading is not timed."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype))
    model.eval()
    head = model.get_output_embeddings().weight[torch.as_tensor(vocab)]
    feats, logits, sec = [], [], 0.0
    for ids in seqs:
        t = time.perf_counter()
        with torch.inference_mode():
            o = model.model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None], output_hidden_states=True)
            lg = o.last_hidden_state[0] @ head.T
        sec += time.perf_counter() - t
        hs = o.hidden_states
        feats.append(torch.cat([hs[i + 1][0] for i in layers], dim=-1).float().numpy())
        logits.append(lg.float().numpy())
    return np.concatenate(feats), np.concatenate(logits), sec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True, help="the target's Hugging Face folder")
    ap.add_argument("--answers", type=Path, required=True)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--min-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=700)
    ap.add_argument("--layers", default="1,13,25")
    ap.add_argument("--draft-vocab", type=int, default=16384, help="the lowest this many token ids")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    from dspark_runtime.machine.sysinfo import machine_description

    seqs = load_sequences(a.answers, a.n, a.min_len, a.max_len)
    if not seqs:
        print(f"no answer of {a.min_len}..{a.max_len} tokens in {a.answers}", file=sys.stderr)
        return 2
    tokens = sum(len(s) for s in seqs)
    vocab = np.arange(a.draft_vocab, dtype=np.int64)
    layers = [int(x) for x in a.layers.split(",")]
    ref_f, ref_l, sec = engine_features(a.engine, seqs, vocab, a.threads)
    rows = [{"path": "engine graph (ONNX Runtime CPU)", "tokens_per_s": tokens / sec}]
    for dtype in a.dtypes.split(","):
        f, lg, s = torch_features(a.target, seqs, vocab, layers, dtype, a.threads)
        rows.append({"path": f"torch {dtype}", "tokens_per_s": tokens / s,
                     "features_rel_l2": float(np.linalg.norm(f - ref_f) / np.linalg.norm(ref_f)),
                     "features_rel_l2_worst_position": float(np.max(np.linalg.norm(f - ref_f, axis=1)
                                                                    / np.linalg.norm(ref_f, axis=1))),
                     "top1_agreement": float(np.mean(lg.argmax(-1) == ref_l.argmax(-1)))})
    for r in rows:
        extra = "" if "top1_agreement" not in r else (
            f" | features rel L2 {r['features_rel_l2']:.4f} (worst position {r['features_rel_l2_worst_position']:.4f})"
            f" | top-1 {100 * r['top1_agreement']:.2f}%")
        print(f"{r['path']:34s} {r['tokens_per_s']:7.1f} tok/s{extra}")
    if a.json:
        a.json.write_text(json.dumps({"machine": machine_description(), "threads": a.threads, "sequences": len(seqs),
                                      "tokens": tokens, "layers": layers, "draft_vocab": a.draft_vocab,
                                      "engine": str(a.engine), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
