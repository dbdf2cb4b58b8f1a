"""The token sequences for ``scripts/gpu_train_draft.py``, made on the CPU from a ``train-draft`` work directory.

    python scripts/gpu_draft_data.py --work ~/.cache/dspark/drafter/RUN \
        --drafter engines/drafters/qwen2.5-coder-1.5b-dspark \
        --target ~/.cache/dspark/models/qwen2.5-coder-1.5b-instruct --out data.npz \
        [--sharegpt-tokens 1200000] [--code-tokens 2400000] [--run-repeats 2]

From the repository root with the project installed (``pip install -e .``), or with ``PYTHONPATH=.``.

Training sequences (never an evaluation or calibration prompt: the answers come from the training split only):

- the run's ``sequences.npz`` (the target's own answers to the training prompts, stdlib source, ShareGPT turns),
  ``--run-repeats`` times (the target's answers among them are what decoding drafts);
- more ShareGPT chats teacher-forced (:func:`dspark_export.drafter.features.sharegpt_sequences`, loss on the answer);
- Python source teacher-forced in 1,024-token chunks: this interpreter's standard library (sub-packages) and the
  ``.py`` files of some installed packages (``--code-tokens`` in all).

Held out: the last ``--heldout`` sequences of the run's feature store (the sequences its training report evaluates
on); every training sequence equal to one of them is dropped. The drafter architecture (``config.json``) and the
draft vocabulary (``draft_vocab_ids``) are copied from ``--drafter``, so the trained checkpoint drops into an engine
that serves that drafter. Output: a compressed ``.npz`` with the fields ``gpu_train_draft.py`` documents.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import site
import sys
import sysconfig
from pathlib import Path

import numpy as np

CODE_PACKAGES = ("transformers", "torch", "numpy", "onnx", "onnxruntime", "tokenizers", "safetensors", "click",
                 "jinja2", "pydantic", "ray", "sympy", "networkx", "fsspec", "huggingface_hub", "pip", "setuptools")


def code_files(seed: int = 1) -> list:
    """Python files over 3 kB of :data:`CODE_PACKAGES` and the standard library's sub-packages, shuffled."""
    roots = [Path(p) / name for p in site.getsitepackages() for name in CODE_PACKAGES]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [f for r in roots if r.exists() for f in r.rglob("*.py") if f.stat().st_size > 3000]
    files += [f for f in stdlib.rglob("*/*.py") if f.stat().st_size > 3000 and "site-packages" not in str(f)]
    random.Random(seed).shuffle(files)
    return files


def new_prompts(work: Path, n: int) -> list:
    """Up to ``n`` training prompts [(source, key, text)] that the run did not answer (so none of its held-out
    answers is answered again): the training split, ShareGPT first turns and code tasks, code-weighted
    (:func:`dspark_export.drafter.data.training_prompt_list`). Never an evaluation or calibration prompt; the user
    turn of a held-out teacher-forced ShareGPT chat can be among them (its answer is then the target's, not the
    held-out one)."""
    from dspark_export.drafter.data import done_keys, training_prompt_list

    done = done_keys(work / "answers.jsonl")
    pool = training_prompt_list(n_sharegpt=n + len(done), n_code_tasks=n + len(done))
    return [p for p in pool if p[1] not in done][:n]


def pack(seqs: list) -> tuple:
    return (np.concatenate([s[0] for s in seqs]).astype(np.int32),
            np.concatenate([s[1] for s in seqs]).astype(np.uint8),
            np.cumsum([0] + [len(s[0]) for s in seqs]).astype(np.int64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="a train-draft work directory (sequences.npz, features/)")
    ap.add_argument("--drafter", type=Path, required=True, help="checkpoint folder whose config and vocabulary to use")
    ap.add_argument("--target", type=Path, required=True, help="the target's Hugging Face folder (its tokenizer)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--heldout", type=int, default=24)
    ap.add_argument("--sharegpt-tokens", type=int, default=1_200_000, help="loss tokens of extra ShareGPT answers")
    ap.add_argument("--code-tokens", type=int, default=2_400_000)
    ap.add_argument("--run-repeats", type=int, default=2)
    ap.add_argument("--answer-prompts", type=int, default=0,
                    help="training prompts (split + ShareGPT first turns) not answered in the run, for the GPU to "
                         "answer (gpu_train_draft.py --answer-minutes); 0: none")
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from dspark_export.drafter.features import FeatureStore, sharegpt_sequences, source_sequences
    from dspark_export.drafter.pipeline import read_sequences

    tok = AutoTokenizer.from_pretrained(str(a.target))
    base = read_sequences(a.work / "sequences.npz")
    store = FeatureStore(a.work / "features")
    held = [store.get(i)[:2] for i in range(len(store) - a.heldout, len(store))]
    skip = {np.asarray(h[0]).tobytes() for h in held}
    run = [s for s in base if s[0].tobytes() not in skip]
    sg = [s for s in sharegpt_sequences(tok, a.sharegpt_tokens, 1024) if s[0].tobytes() not in skip]
    code = source_sequences(tok, code_files(), a.code_tokens, 1024, skip=skip, whole_files=True)
    seqs = run * a.run_repeats + sg + code
    random.Random(0).shuffle(seqs)
    ti, tm, ts = pack(seqs)
    hi, hm, hs = pack([(np.asarray(i, np.int32), np.asarray(m, np.uint8)) for i, m in held])
    vocab = safe_open(str(a.drafter / "model.safetensors"), "pt").get_tensor("draft_vocab_ids").numpy()
    config = np.frombuffer((a.drafter / "config.json").read_bytes(), np.uint8)
    extra = {}
    if a.answer_prompts:
        extra["prompts"] = np.frombuffer(json.dumps(new_prompts(a.work, a.answer_prompts)).encode(), np.uint8)
    np.savez_compressed(a.out, ids=ti, mask=tm, starts=ts, held_ids=hi, held_mask=hm, held_starts=hs,
                        draft_vocab_ids=vocab, config=config, **extra)
    print(f"{a.out}: {len(ts) - 1} training sequences, {len(ti)} tokens ({int(tm.sum())} loss tokens); tokens by "
          f"source: the run's {sum(len(s[0]) for s in run)} (x{a.run_repeats}), ShareGPT "
          f"{sum(len(s[0]) for s in sg)}, code {sum(len(s[0]) for s in code)}; {len(held)} held out, {len(hi)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
