"""Pure pieces of the drafter training pipeline: anchors, blocks, vocabulary, prompt splits."""
import json

import numpy as np
import pytest

pytest.importorskip("torch")

from dspark_export.draft_data import CALIB_SPLIT, TRAIN_SPLIT, interleave, split_prompts  # noqa: E402
from dspark_export.draft_features import choose_draft_vocab  # noqa: E402
from dspark_export.draft_train import block_batch, sample_anchors  # noqa: E402


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


def test_engine_answers_are_the_engines_greedy_output_and_resume(tiny_engine_dir, tmp_path, monkeypatch):
    """generate_answers_engine (train-draft --engine): each row is the prompt's ids + the engine's greedy
    target-only continuation (what decoding the prompt alone gives), the format answer_sequences reads;
    a second call skips the keys already written and adds only new prompts."""
    from dspark_export import draft_data
    from dspark_export.draft_features import answer_sequences
    from dspark_runtime import Engine

    prompts = [("mbpp", "mbpp:1", "Write a function that adds two numbers."), ("gsm8k", "gsm8k:1", "What is 7 * 6?"),
               ("sharegpt", "sharegpt:1", "Say hello."), ("math500", "math500:1", "Solve x + 2 = 5.")]
    monkeypatch.setattr(draft_data, "training_prompt_list", lambda n_sharegpt=0: prompts)
    out = tmp_path / "answers.jsonl"
    r = draft_data.generate_answers_engine(tiny_engine_dir, out, max_new_tokens=10, max_batch=2, group=2, limit=3,
                                           threads=1, log=lambda *a: None)
    assert r["prompts"] == 3
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [x["key"] for x in rows] == ["mbpp:1", "gsm8k:1", "sharegpt:1"]
    eng = Engine.load(tiny_engine_dir, threads=1)
    for row, (_, _, text) in zip(rows, prompts):
        ids = eng.encode_prompt(text)
        solo = eng.generate(text, max_new_tokens=10, draft=None)
        assert row["prompt_len"] == len(ids) and row["ids"] == list(ids) + list(solo.token_ids)
    assert r["new_tokens"] == sum(len(x["ids"]) - x["prompt_len"] for x in rows)
    r2 = draft_data.generate_answers_engine(tiny_engine_dir, out, max_new_tokens=10, max_batch=2, group=2, limit=4,
                                            threads=1, log=lambda *a: None)
    rows2 = [json.loads(l) for l in out.read_text().splitlines()]
    assert r2["prompts"] == 4 and [x["key"] for x in rows2][3:] == ["math500:1"] and rows2[:3] == rows
    long_enough = [x for x in rows2 if len(x["ids"]) - x["prompt_len"] >= 8]  # answer_sequences' minimum
    assert long_enough  # the tiny model rarely stops within 10 tokens
    seqs = answer_sequences(out, 1024)
    assert len(seqs) == len(long_enough)
    assert all(int(m[:x["prompt_len"]].sum()) == 0 and int(m.sum()) == len(x["ids"]) - x["prompt_len"]
               for (_, m), x in zip(seqs, long_enough))
