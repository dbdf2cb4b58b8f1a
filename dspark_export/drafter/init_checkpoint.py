"""Continuing a DSpark checkpoint in ``dspark-export train-draft --init`` (:func:`settings_from_checkpoint`): the run's
settings from the checkpoint, its draft vocabulary, and the checks that the run's data fit it."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from dspark_runtime.errors import DSparkError

from dspark_export.drafter.checkpoint import read_tensors
from dspark_export.drafter.config import load_config


def settings_from_checkpoint(p, ckpt: Path):
    """``p`` (a :class:`~dspark_export.drafter.pipeline.PipelineSettings`) with the architecture of the DSpark checkpoint ``ckpt`` whose training a run continues: layers, widths,
    block size, Markov and confidence heads, MoE, the draft vocabulary's size, the mask token and the target layers
    it reads (``feature_layers``), and ``init`` set to ``ckpt``. Raises DSparkError (naming the fix) for an EAGLE-3
    run or a folder whose ``config.json`` is not a DSpark drafter's."""
    if p.method != "dspark":
        raise DSparkError(f"--init continues a DSpark (or DFlash) drafter; an {p.method} run starts from scratch: drop "
                          "--init or --method")
    c = load_config(ckpt)
    return replace(p, init=str(ckpt), num_layers=c.num_hidden_layers, intermediate_size=c.intermediate_size,
                   block_size=c.block_size, markov_rank=c.markov_rank,
                   markov_head_type=c.markov_head_type or p.markov_head_type,
                   confidence_head=c.enable_confidence_head, moe_experts=c.draft_moe_experts,
                   moe_top_k=c.draft_moe_top_k or p.moe_top_k, moe_intermediate_size=c.draft_moe_intermediate_size,
                   draft_vocab_size=c.draft_vocab_size or 0, mask_token_id=c.mask_token_id,
                   feature_layers=tuple(c.target_layer_ids))


def checkpoint_vocab(ckpt: Path) -> np.ndarray | None:
    """The draft vocabulary (int64 target ids, ascending) of the checkpoint ``ckpt``; None for a full-vocabulary
    drafter."""
    ids = read_tensors(ckpt).get("draft_vocab_ids")
    return None if ids is None else ids.numpy().astype(np.int64)


def cached_vocab(feat_dir: Path, vocab: np.ndarray | None, init: str | None) -> np.ndarray:
    """The draft vocabulary the feature cache in ``feat_dir`` stored its target logits over. A run continuing the
    checkpoint ``init`` needs it to be that checkpoint's (``vocab``): raises DSparkError otherwise."""
    cached = np.load(feat_dir / "draft_vocab.npy")
    if init is not None and (vocab is None or not np.array_equal(cached, vocab)):
        raise DSparkError(f"{feat_dir} stores the target's logits over another draft vocabulary than the one of "
                          f"{init}; continue that checkpoint on features extracted over its vocabulary (a new --work "
                          "run with --init extracts them), or train from scratch")
    return cached


def check_reused_data_fits(pipeline: dict, src_dir: Path, defaults) -> None:
    """A new run continuing a checkpoint (``pipeline["init"]``) on the data of ``src_dir``: the data must hold the
    target layers the checkpoint reads. Raises DSparkError naming both."""
    want = list(settings_from_checkpoint(defaults, Path(pipeline["init"])).feature_layers)
    if list(pipeline["feature_layers"]) != want:
        raise DSparkError(f"{src_dir} holds features of target layers {list(pipeline['feature_layers'])}, but "
                          f"{pipeline['init']} reads layers {want}: reuse the data of a run with those layers")
