"""Pure pieces of the drafter training pipeline: anchors, blocks, vocabulary, prompt splits."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")

from dspark_export.draft_data import CALIB_SPLIT, TRAIN_SPLIT, interleave, split_prompts  # noqa: E402
from dspark_export.draft_train import block_batch, choose_draft_vocab, sample_anchors  # noqa: E402


def test_anchors_need_the_anchor_and_its_next_token_in_the_loss_mask():
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 1], np.uint8)
    rng = np.random.default_rng(0)
    got = sample_anchors(mask, 10, rng)
    assert got.tolist() == [2, 3, 6]  # 4 is excluded (5 is masked), 7 has no next token
    assert len(sample_anchors(mask, 2, rng)) == 2


def test_block_batch_labels_prev_tokens_and_eval_mask():
    import torch

    ids = np.arange(10, 20, dtype=np.int32)
    mask = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1], np.uint8)
    aux = np.arange(10, dtype=np.float32)[:, None].repeat(3, 1)  # row i holds value i
    feats = np.zeros((10, 4), np.float32)
    t2d = torch.arange(100)
    b = block_batch([(ids, mask, feats, aux)], [np.array([2, 7])], gamma=3, mask_token=99, t2d=t2d)
    assert b["labels"][0].tolist() == [[13, 14, 15], [18, 19, 10]]  # block 2 runs past the end (padded)
    assert b["eval_mask"][0].tolist() == [[True, True, True], [True, True, False]]
    assert b["prev_in"][0, 0].tolist() == [12, 13, 14]  # anchor, then the true previous tokens
    assert b["block_ids"][0].tolist() == [12, 99, 99, 17, 99, 99]
    assert b["block_pos"][0].tolist() == [2, 3, 4, 7, 8, 9]
    # the target row predicting label j is j - 1
    assert b["last"][0, 0, :, 0].tolist() == [2.0, 3.0, 4.0]


def test_draft_vocabulary_keeps_the_most_frequent_ids_and_the_forced_ones():
    counts = np.array([5, 0, 9, 1, 7, 0])
    assert choose_draft_vocab(counts, 3).tolist() == [0, 2, 4]
    assert choose_draft_vocab(counts, 3, always=[5]).tolist() == [2, 4, 5]


def test_training_and_calibration_splits_never_touch_evaluation_prompts():
    train, calib = split_prompts(TRAIN_SPLIT), split_prompts(CALIB_SPLIT)
    assert len(train["gsm8k"]) == 900 and len(train["mbpp"]) == 180 and len(train["math500"]) == 350
    assert len(calib["gsm8k"]) == 100 and len(calib["mbpp"]) == 20 and len(calib["math500"]) == 50
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from evalsets import EVAL_START
    for name, (a, b) in list(TRAIN_SPLIT.items()) + list(CALIB_SPLIT.items()):
        assert b <= EVAL_START[name]
    keys = {k for v in train.values() for k, _ in v} & {k for v in calib.values() for k, _ in v}
    assert not keys
    assert json.loads  # prompts are plain strings
    assert all(isinstance(t, str) and t for v in train.values() for _, t in v)


def test_interleave_round_robin():
    got = interleave({"a": [(1,), (2,), (3,)], "b": [(4,)]}, ["a", "b", "a"])
    assert got == [("a", 1), ("b", 4), ("a", 2), ("a", 3)]
