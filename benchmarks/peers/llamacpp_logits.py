"""llama.cpp's logits at every position of given token-id sequences (teacher forced), for fidelity checks of our
graphs against llama.cpp on the same GGUF (``benchmarks.int4_fidelity``). Runs under the llama-cpp peer venv:

    PYTHONPATH=. ~/.cache/dspark/peers/llama-cpp/venv/bin/python -m benchmarks.peers.llamacpp_logits \\
        ~/.cache/dspark/gguf/qwen2.5-coder-1.5b-instruct.gguf ids.json out/ [--threads 2]

ids.json: a list of token-id lists (named 0000, 0001, ...) or ``{"name": [ids...]}``, fed as they are. Writes
``out/<name>.npy`` (float32 (len(ids), n_vocab): row i = the logits after ids[0..i], ``Llama(logits_all=True)`` in
batches of ``--n-batch``, which the results depend on slightly) and ``out/index.json`` (entries, GGUF, versions).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path


def load_ids(path: Path) -> list:
    """[(name, ids)] from a JSON list of lists or a {name: ids} object; validates the ids."""
    data = json.loads(Path(path).read_text())
    items = list(data.items()) if isinstance(data, dict) else [(f"{k:04d}", v) for k, v in enumerate(data)]
    out = []
    for name, ids in items:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise SystemExit(f"error: {path}: entry {name!r} is not a non-empty list of token ids")
        if not str(name) or "/" in str(name) or str(name).startswith("."):
            raise SystemExit(f"error: {path}: entry name {name!r} cannot be a file name")
        out.append((str(name), ids))
    if not out:
        raise SystemExit(f"error: {path} holds no token-id list")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("ids_json")
    ap.add_argument("out_dir")
    ap.add_argument("--threads", type=int, default=min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 8),
                    help="threads (default: the CPUs this process may use, at most 8)")
    ap.add_argument("--n-batch", type=int, default=512, help="tokens per llama_decode call (default 512)")
    a = ap.parse_args(argv)
    entries = load_ids(Path(a.ids_json))

    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    n_max = max(len(ids) for _, ids in entries)
    n_ctx = max(-(-n_max // 64) * 64, a.n_batch)  # n_batch as asked, whatever the longest list
    t0 = time.perf_counter()
    llm = Llama(model_path=a.gguf, n_ctx=n_ctx, n_batch=min(a.n_batch, n_ctx), n_ubatch=min(a.n_batch, n_ctx),
                n_threads=a.threads, n_threads_batch=a.threads, logits_all=True, verbose=False)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()
    bad = [name for name, ids in entries if max(ids) >= n_vocab]
    if bad:
        raise SystemExit(f"error: entries {bad} hold ids >= the GGUF's vocabulary ({n_vocab})")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {"gguf": str(Path(a.gguf).resolve()), "gguf_bytes": Path(a.gguf).stat().st_size,
             "llama_cpp_python": llama_cpp.__version__, "threads": a.threads, "n_batch": min(a.n_batch, n_ctx),
             "n_ctx": n_ctx, "n_vocab": n_vocab, "load_s": load_s, "entries": []}
    for name, ids in entries:
        t = time.perf_counter()
        llm.reset()  # position 0, the KV cache dropped (eval removes everything past n_tokens)
        llm.eval(ids)
        logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
        f = out / f"{name}.npy"
        np.save(f, logits)
        index["entries"].append({"name": name, "file": f.name, "n_tokens": len(ids),
                                 "ids_sha1": hashlib.sha1(json.dumps(ids).encode()).hexdigest(),
                                 "shape": list(logits.shape), "last_argmax": int(logits[-1].argmax()),
                                 "eval_s": time.perf_counter() - t})
        print(f"{name}: {len(ids)} positions -> {f}", file=sys.stderr)
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"wrote {len(entries)} logits files and {out / 'index.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
