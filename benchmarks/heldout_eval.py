"""Held-out teacher-forced acceptance of DSpark drafter checkpoints on the deployed engine's own arithmetic.

The held-out sequences of DATA (``held_ids``/``held_mask``/``held_starts``, as ``scripts/gpu_draft_data.py`` writes
them) go once through the engine's compiled target graph; then every checkpoint (all sharing the first one's draft
vocabulary) is scored with the training reports' metric: acceptance by block position and tau, greedy.

    python -m benchmarks.heldout_eval --engine engines/qwen2.5-coder-1.5b --data data.npz \\
        --target ~/.cache/dspark/models/qwen2.5-coder-1.5b-instruct CKPT_DIR [CKPT_DIR ...] [--out result.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", type=Path)
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True, help="the target's Hugging Face folder (embedding, head)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch
    from safetensors import safe_open

    from dspark_export.drafter.features import FeatureStore, extract_features_ort
    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.drafter.train import TrainSettings, heldout_acceptance
    from dspark_export.drafter.checkpoint import load_checkpoint

    z = np.load(a.data)
    held = [(z["held_ids"][s:e], z["held_mask"][s:e]) for s, e in zip(z["held_starts"][:-1], z["held_starts"][1:])]
    vocabs = []
    for c in a.checkpoints:
        with safe_open(str(c / "model.safetensors"), "pt") as f:
            if "draft_vocab_ids" not in f.keys():
                sys.exit(f"{c}: no draft_vocab_ids (a full-vocabulary drafter); this script scores reduced-vocabulary "
                         "drafters over the engine's logits of that vocabulary")
            vocabs.append(f.get_tensor("draft_vocab_ids").numpy())
    if any(not np.array_equal(v, vocabs[0]) for v in vocabs[1:]):
        sys.exit("the checkpoints' draft vocabularies differ: evaluate each group of equal vocabularies separately")
    emb, head = target_frozen_weights(a.target)
    res = {"engine": str(a.engine), "heldout_sequences": len(held), "heldout_tokens": int(sum(len(h[0]) for h in held))}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        extract_features_ort(a.engine, held, Path(tmp), vocabs[0], shard_tokens=1 << 30)
        res["features_s"] = time.perf_counter() - t
        store = FeatureStore(Path(tmp))
        s = TrainSettings(eval_seqs=len(store))
        for c in a.checkpoints:
            torch.manual_seed(0)
            model = load_checkpoint(c, target_embed=emb, target_lm_head=head)
            cfg = model.config
            r = heldout_acceptance(store, range(len(store)), model, None, s, gamma=cfg.block_size,
                                   mask_token=cfg.mask_token_id)
            res[str(c)] = r
            print(f"{c}: acceptance by position {r['heldout_acc_pos']}, tau {r['heldout_tau_greedy']:.3f}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
