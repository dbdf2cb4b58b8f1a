"""Pure pieces of the drafter training pipeline: anchors, blocks, vocabulary, prompt splits."""
import json
import math

import numpy as np
import pytest

pytest.importorskip("torch")

from dspark_export.drafter.data import CALIB_SPLIT, TRAIN_SPLIT, interleave, split_prompts  # noqa: E402
from dspark_export.drafter.features import choose_draft_vocab  # noqa: E402
from dspark_export.drafter.train import TrainSettings, block_batch, sample_anchors  # noqa: E402


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
    from benchmarks.evalsets import EVAL_START
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
    from dspark_export.drafter import data as draft_data
    from dspark_export.drafter.features import answer_sequences
    from dspark_runtime import Engine

    prompts = [("mbpp", "mbpp:1", "Write a function that adds two numbers."), ("gsm8k", "gsm8k:1", "What is 7 * 6?"),
               ("sharegpt", "sharegpt:1", "Say hello."), ("math500", "math500:1", "Solve x + 2 = 5.")]
    monkeypatch.setattr(draft_data, "training_prompt_list", lambda n_sharegpt=0, n_code_tasks=0: prompts)
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


# --- resumable training: a run killed mid-way and resumed ends where an uninterrupted one does ----------------

def _synthetic_store(root, vocab=40, hidden=16, n_feat=2, seqs=10, seed=0):
    """A FeatureStore of random sequences (ids, loss mask, target features, target logits over the vocabulary)."""
    from dspark_export.drafter.features import FeatureStore, _write_shard

    rng = np.random.default_rng(seed)
    shard = []
    for _ in range(seqs):
        n = int(rng.integers(24, 40))
        shard.append((rng.integers(0, vocab - 1, n).astype(np.int32), np.ones(n, np.uint8)))
    feats = [rng.standard_normal((len(a), n_feat * hidden)).astype(np.float16) for a, _ in shard]
    logits = [rng.standard_normal((len(a), vocab)).astype(np.float16) for a, _ in shard]
    root.mkdir(parents=True, exist_ok=True)
    _write_shard(root, 0, shard, feats, "tlogits", logits)
    return FeatureStore(root)


def _tiny_drafter(vocab=40, hidden=16):
    import torch

    from dspark_export.drafter.model import DSparkDraftModel, qwen2_draft_config

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
           "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
           "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
           "max_position_embeddings": 256, "tie_word_embeddings": True}
    c = qwen2_draft_config(cfg, mask_token_id=vocab - 1, num_layers=1, intermediate_size=32, block_size=4,
                           target_layer_ids=(-1, 0), markov_rank=8, draft_vocab_size=vocab)
    torch.manual_seed(0)
    m = DSparkDraftModel(c)
    m.draft_vocab_ids.copy_(torch.arange(vocab))
    w = torch.randn(vocab, hidden) * 0.1
    m.init_from_target(w, w)
    return m


class _Killed(Exception):
    pass


def test_training_killed_and_resumed_equals_an_uninterrupted_run(tmp_path):
    import torch

    from dspark_export.drafter.train import TRAIN_STATE, TrainSettings, train

    store = _synthetic_store(tmp_path / "features")
    s = TrainSettings(lr=3e-3, warmup_steps=3, anchors_per_seq=4, epochs=2.0, eval_every=5, eval_seqs=2,
                      save_every_s=0.0, time_budget_s=600)
    assert s.total_steps(8) == 8  # 2 epochs x 8 training sequences / 2 per step

    straight = _tiny_drafter()
    rep = train(store, straight, None, tmp_path / "a", s, gamma=4, mask_token=39, log=lambda *a: None)
    assert rep["finished"] and rep["steps"] == 8

    def killer(msg):  # the process dies right after step 5's evaluation (state last saved after step 4)
        if msg.startswith("[train] step 5/"):
            raise _Killed()

    resumed = _tiny_drafter()
    state = tmp_path / TRAIN_STATE
    with pytest.raises(_Killed):
        train(store, resumed, None, tmp_path / "b", s, gamma=4, mask_token=39, log=killer, resume=state)
    assert torch.load(state, weights_only=False)["step"] == 4
    fresh = _tiny_drafter()  # a new process: a new model, everything else from the state file
    lines = []
    rep2 = train(store, fresh, None, tmp_path / "b", s, gamma=4, mask_token=39, log=lines.append, resume=state)
    assert any("resumed at step 4/8" in x for x in lines) and rep2["finished"] and rep2["steps"] == 8
    a, b = straight.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], _tiny_drafter().state_dict()[k]) for k in a)  # it did train


def test_bf16_autocast_trains_like_fp32_but_is_applied(tmp_path):
    import torch

    from dspark_export.drafter.train import TrainSettings, bf16_native, train

    store = _synthetic_store(tmp_path / "features")
    init = {k: v.clone() for k, v in _tiny_drafter().state_dict().items()}
    runs = {}
    for bf16 in (False, True):
        s = TrainSettings(lr=3e-3, warmup_steps=3, anchors_per_seq=4, epochs=2.0, eval_every=100, eval_seqs=2,
                          time_budget_s=600, bf16=bf16)
        m, lines = _tiny_drafter(), []
        rep = train(store, m, None, tmp_path / str(bf16), s, gamma=4, mask_token=39, log=lines.append)
        assert rep["finished"] and rep["steps"] == 8
        assert any(("bf16 autocast" if bf16 else "fp32);") in x for x in lines)
        runs[bf16] = torch.cat([(m.state_dict()[k] - init[k]).flatten().float() for k in init
                                if m.state_dict()[k].is_floating_point()])
    a, b = runs[False], runs[True]
    assert a.abs().sum() > 0 and not torch.equal(a, b)  # trained, and the bf16 forward changed the numbers
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=0)) > 0.95  # ... but not the direction of training
    assert bf16_native(["avx512f", "amx_tile", "amx_bf16"]) and not bf16_native(["avx512f", "avx512_bf16"])


def test_run_state_refuses_other_settings_and_a_missing_run(tmp_path):
    from dspark_export.drafter.pipeline import RunState
    from dspark_runtime.errors import DSparkError

    with pytest.raises(DSparkError, match="holds no train-draft run"):
        RunState.open(tmp_path, None)
    run = {"target": "t", "engine": None, "out": "o", "pipeline": {"num_layers": 1}, "train": {"lr": 1e-3}}
    RunState.open(tmp_path, run).stage("answers")["done"] = True
    assert RunState.open(tmp_path, None).data["pipeline"] == {"num_layers": 1}
    with pytest.raises(DSparkError, match=r"other settings \(pipeline.num_layers\).*--resume"):
        RunState.open(tmp_path, dict(run, pipeline={"num_layers": 2}))
    # the same settings again (time budget aside) continue the run
    assert RunState.open(tmp_path, dict(run, train={"lr": 1e-3, "time_budget_s": 5})).data["out"] == "o"


def test_seed_answers_import_only_missing_training_prompts(tmp_path):
    import gzip

    from dspark_export.drafter.pipeline import import_answers
    from dspark_runtime.errors import DSparkError

    rec = lambda k: json.dumps({"key": k, "source": k.split(":")[0], "ids": [1, 2, 3], "prompt_len": 2})  # noqa: E731
    src = tmp_path / "seed.jsonl.gz"
    with gzip.open(src, "wt") as f:
        f.write("\n".join(rec(k) for k in ("gsm8k:1", "mbpp:3", "sharegpt:QWJhYvA_0", "code-task:shlex.quote")) + "\n")
    answers = tmp_path / "work" / "answers.jsonl"
    answers.parent.mkdir()
    answers.write_text(rec("mbpp:3") + "\n")
    assert import_answers(src, answers) == 3
    assert [json.loads(x)["key"] for x in answers.read_text().splitlines()] == ["mbpp:3", "gsm8k:1",
                                                                                "sharegpt:QWJhYvA_0",
                                                                                "code-task:shlex.quote"]
    assert import_answers(src, answers) == 0  # idempotent
    small = tmp_path / "small" / "answers.jsonl"
    assert import_answers(src, small, limit=2) == 2  # --answer-prompts 2: the file's first two records
    assert [json.loads(x)["key"] for x in small.read_text().splitlines()] == ["gsm8k:1", "mbpp:3"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(rec("gsm8k:950") + "\n")  # gsm8k 901-1000 is the calibration split
    with pytest.raises(DSparkError, match="line 1: 'gsm8k:950' is not a training prompt"):
        import_answers(bad, answers)
    for key in ("sharegpt:no-such-record", "code-task:shlex.no_such_function", "sharegpt:PIwT1bi_0"):
        bad.write_text(rec(key) + "\n")  # the last one shares a run of words with a held-out prompt
        with pytest.raises(DSparkError, match=f"'{key}' is not a training prompt"):
            import_answers(bad, answers)
    bad.write_text('{"key": "gsm8k:2"}\n')
    with pytest.raises(DSparkError, match="line 1: not an answer record"):
        import_answers(bad, answers)


def test_pipeline_stops_at_its_time_limit_and_resumes_to_the_end(tiny_engine_dir, tiny_pair, tmp_path, monkeypatch):
    """train-draft end to end on the tiny engine: a call whose time limit is spent stops in stage 1 with its state
    saved; --resume (no settings) runs answers -> sequences -> features -> training to a checkpoint and a report."""
    from dspark_export.drafter import data as draft_data
    from dspark_export.drafter.pipeline import PipelineSettings, train_draft_pipeline
    from dspark_export.drafter.train import TrainSettings

    prompts = [("mbpp", f"mbpp:{i}", f"Write a function number {i}.") for i in range(1, 4)] + \
              [("gsm8k", f"gsm8k:{i}", f"What is {i} * 6?") for i in range(1, 4)]
    monkeypatch.setattr(draft_data, "training_prompt_list", lambda n_sharegpt=0, n_code_tasks=0: prompts)
    p = PipelineSettings(answer_tokens=16, answer_batch=2, sharegpt_prompts=0, stdlib_tokens=800, sharegpt_tokens=0,
                         max_seq_len=256, feature_layers=(-1, 0), draft_vocab_size=64, intermediate_size=32,
                         block_size=4, markov_rank=8,
                         mask_token_id=json.loads((tiny_pair[0] / "config.json").read_text())["vocab_size"] - 1)
    s = TrainSettings(lr=3e-3, epochs=2.0, eval_seqs=2, anchors_per_seq=4, warmup_steps=2, eval_every=1000)
    work, out = tmp_path / "work", tmp_path / "ckpt"
    r = train_draft_pipeline(tiny_pair[0], work, out, p, s, engine_dir=tiny_engine_dir, time_limit_s=1e-9,
                             compile_into_engine=False, log=lambda *a: None)
    assert not r["finished"] and not r["stages"]["answers"]["done"]
    started = json.loads((work / "state.json").read_text())
    assert started["pipeline"]["feature_layers"] == [-1, 0] and started["compile"] is False
    lines = []
    r = train_draft_pipeline(None, work, None, None, None, log=lines.append)  # --resume keeps --no-compile
    st = r["stages"]
    assert r["finished"] and all(st[k]["done"] for k in ("answers", "sequences", "features", "train"))
    assert st["answers"]["prompts"] == 6 and st["answers"]["new_tokens"] > 0
    by_source = st["sequences"]["loss_tokens_by_source"]
    assert by_source["answers"] > 0 and by_source["stdlib"] > 0
    assert st["features"]["new_tokens"] == st["sequences"]["tokens"]
    assert st["train"]["report"]["finished"] and st["train"]["report"]["steps"] == st["train"]["report"]["total_steps"]
    assert (out / "config.json").is_file() and r["checkpoint_bytes"] > 0
    rep = json.loads((out / "train_report.json").read_text())
    assert rep["stages"]["features"]["tokens_per_s"] > 0 and "machine" in rep
    assert not st["calibrate"]["done"]  # --no-compile: the engine is left as it is
    r = train_draft_pipeline(None, work, None, None, None, compile_into_engine=False, log=lambda *a: None)
    assert r["finished"]  # a finished run resumes to its end at once
    # another configuration on the same data: no answer or feature is made again, the features are shared
    from dataclasses import replace

    import dspark_export.drafter.pipeline as dp
    from dspark_runtime.errors import DSparkError

    monkeypatch.setattr(dp, "extract_features_ort", lambda *a, **k: pytest.fail("features extracted again"))
    monkeypatch.setattr(draft_data, "generate_answers_engine", lambda *a, **k: pytest.fail("answered again"))
    # DeepSpec's DFlash (no Markov, no confidence head); a data setting given here is replaced by the reused run's
    p2 = replace(p, markov_rank=0, confidence_head=False, stdlib_tokens=5)
    work2, lines = tmp_path / "work2", []
    r2 = train_draft_pipeline(tiny_pair[0], work2, tmp_path / "ckpt2", p2, replace(s, ce_alpha=1.0),
                              compile_into_engine=False, reuse_data=work, log=lines.append)
    d2 = json.loads((work2 / "state.json").read_text())
    assert r2["finished"] and (work2 / "features").resolve() == (work / "features").resolve()
    assert d2["pipeline"]["stdlib_tokens"] == 800 and d2["pipeline"]["markov_rank"] == 0
    assert d2["engine"] == str(tiny_engine_dir) and d2["stages"]["features"]["reused_from"] == str(work)
    assert d2["train"]["ce_alpha"] == 1.0 and r2["train"]["finished"]
    cfg2 = json.loads((tmp_path / "ckpt2" / "config.json").read_text())
    assert cfg2["markov_rank"] == 0 and cfg2["enable_confidence_head"] is False and "markov_head_type" not in cfg2
    assert any("reused from" in x for x in lines)
    # continuing the first run's checkpoint on the same data (--init): its architecture is kept whatever p says
    # (Markov rank 8, not 0), and at learning rate 0 the weights written are exactly the checkpoint's
    import torch

    from dspark_export.drafter.checkpoint import read_tensors

    p4 = replace(p, markov_rank=0, confidence_head=False, init=str(out))
    r4 = train_draft_pipeline(tiny_pair[0], tmp_path / "work4", tmp_path / "ckpt4", p4, replace(s, lr=0.0),
                              compile_into_engine=False, reuse_data=work, log=lines.append)
    d4 = json.loads((tmp_path / "work4" / "state.json").read_text())
    assert r4["finished"] and d4["pipeline"]["init"] == str(out) and d4["pipeline"]["markov_rank"] == 8
    def trainable(prefix):  # "[4/5] training...: 0.1 M trainable parameters, ..." -> "0.1"
        return [x.split(": ", 1)[1].split(" M ")[0] for x in lines if x.startswith(prefix)]

    assert trainable(f"[4/5] training continues {out}") == trainable("[4/5] training: ")[:1]  # frozen embedding/head
    w0, w4 = read_tensors(out), read_tensors(tmp_path / "ckpt4")
    assert sorted(w0) == sorted(w4) and all(torch.equal(w0[k], w4[k]) for k in w0)
    # an EAGLE-3 drafter on the same data (--method eagle3): the engine's features hold logits over the run's draft
    # vocabulary, which the drafter's head then covers (written in SpecForge's layout, d2t / t2d); the decoder layer
    # 0 of layers (-1, 0) is fused; stage 5 compiles it beside the other drafters
    from dspark_export.drafter.eagle3 import load_eagle3_checkpoint
    from dspark_export.drafter.graph import target_frozen_weights

    compiled = []
    monkeypatch.setattr(dp, "add_eagle3_draft", lambda eng, ckpt, log: compiled.append((eng, ckpt)))
    p3 = replace(p, method="eagle3", ttt_length=3, intermediate_size=64)
    r3 = train_draft_pipeline(tiny_pair[0], tmp_path / "work3", tmp_path / "ckpt3", p3, replace(s, lr=1e-2),
                              reuse_data=work, log=lambda *a: None)
    assert r3["finished"] and r3["train"]["finished"] and len(r3["train"]["heldout_acc_pos"]) == 3
    assert json.loads((tmp_path / "ckpt3" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    m3 = load_eagle3_checkpoint(tmp_path / "ckpt3", target_embed=target_frozen_weights(tiny_pair[0])[0])
    assert m3.config.target_layer_ids == [0] and m3.config.intermediate_size == 64
    assert m3.draft_vocab_ids.tolist() == np.load(work / "features" / "draft_vocab.npy").tolist()  # 64 ids
    assert compiled == [(tiny_engine_dir, tmp_path / "ckpt3")] and r3["stages"]["calibrate"]["done"]
    unfinished = tmp_path / "unfinished"  # a run stopped before its features: nothing to reuse yet
    unfinished.mkdir()
    (unfinished / "state.json").write_text(json.dumps({"target": str(tiny_pair[0]), "engine": None, "out": "o",
                                                       "pipeline": {}, "train": {}, "stages": {}}))
    with pytest.raises(DSparkError, match="features stage is not finished.*--resume"):
        train_draft_pipeline(tiny_pair[0], tmp_path / "w3", tmp_path / "c3", p, s, reuse_data=unfinished,
                             log=lambda *a: None)


def test_capped_shards_keep_the_leading_shards_that_start_before_the_cap():
    from dspark_export.drafter.features import _capped_shards
    from dspark_runtime.errors import DSparkError

    seq = lambda n: (np.zeros(n, np.int32), np.ones(n, np.uint8))  # noqa: E731
    shards = [[seq(100)], [seq(60), seq(40)], [seq(100)]]
    assert _capped_shards(shards, None) is shards
    assert len(_capped_shards(shards, 1)) == 1
    assert len(_capped_shards(shards, 100)) == 1  # the second shard starts at token 100: not before the cap
    assert len(_capped_shards(shards, 101)) == 2
    assert len(_capped_shards(shards, 10_000)) == 3
    with pytest.raises(DSparkError, match="positive number of tokens"):
        _capped_shards(shards, 0)


def test_feature_token_cap_sizes_a_run_in_progress_until_training_starts(tiny_engine_dir, tiny_pair, tmp_path,
                                                                          monkeypatch):
    """A run stopped before its features can be resumed with a token cap: only the leading shards get features,
    training uses exactly those, and once training has started the cap can no longer change."""
    from functools import partial

    from dspark_export.drafter import data as draft_data
    from dspark_export.drafter import features as draft_features
    from dspark_export.drafter import pipeline as draft_pipeline
    from dspark_export.drafter.features import FeatureStore
    from dspark_export.drafter.pipeline import PipelineSettings, train_draft_pipeline
    from dspark_export.drafter.train import TrainSettings
    from dspark_runtime.errors import DSparkError

    prompts = [("mbpp", f"mbpp:{i}", f"Write a function number {i}.") for i in range(1, 4)]
    monkeypatch.setattr(draft_data, "training_prompt_list", lambda n_sharegpt=0, n_code_tasks=0: prompts)
    monkeypatch.setattr(draft_pipeline, "extract_features_ort",
                        partial(draft_features.extract_features_ort, shard_tokens=150))
    p = PipelineSettings(answer_tokens=16, answer_batch=2, sharegpt_prompts=0, stdlib_tokens=1200, sharegpt_tokens=0,
                         max_seq_len=128, feature_layers=(-1, 0), draft_vocab_size=64, intermediate_size=32,
                         block_size=4, markov_rank=8,
                         mask_token_id=json.loads((tiny_pair[0] / "config.json").read_text())["vocab_size"] - 1)
    s = TrainSettings(lr=3e-3, epochs=1.0, eval_seqs=1, anchors_per_seq=4, warmup_steps=2, eval_every=1000)
    work = tmp_path / "work"
    r = train_draft_pipeline(tiny_pair[0], work, tmp_path / "ckpt", p, s, engine_dir=tiny_engine_dir,
                             time_limit_s=1e-9, log=lambda *a: None)
    assert not r["finished"]
    r = train_draft_pipeline(None, work, None, None, None, compile_into_engine=False, feature_tokens=300,
                             log=lambda *a: None)
    st = r["stages"]
    assert r["finished"] and json.loads((work / "state.json").read_text())["pipeline"]["feature_tokens"] == 300
    total = st["sequences"]["tokens"]
    got = FeatureStore(work / "features").num_tokens
    assert total > 600 and 300 <= got < total  # the cap took effect and kept whole shards
    assert st["features"]["new_tokens"] == got == st["train"]["tokens"]
    with pytest.raises(DSparkError, match="can no longer change"):
        train_draft_pipeline(None, work, None, None, None, compile_into_engine=False, feature_tokens=600,
                             log=lambda *a: None)


def test_cli_reuse_data_refuses_data_settings_and_needs_its_own_work_dir(tmp_path):
    """`train-draft --reuse-data RUN` takes that run's data settings: giving one of them, or no --work of its own,
    is refused with the flag named (before anything is loaded)."""
    from click.testing import CliRunner

    from dspark_export.cli import cli as main

    args = ["train-draft", "--out", str(tmp_path / "c"), "--reuse-data", str(tmp_path)]
    r = CliRunner().invoke(main, args + ["--work", str(tmp_path / "w"), "--stdlib-tokens", "5", "--draft-vocab", "8"])
    assert r.exit_code == 2 and "drop --stdlib-tokens, --draft-vocab" in r.output
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "give it its own --work directory" in r.output


def test_init_keeps_the_checkpoints_architecture_and_vocabulary_and_refuses_what_does_not_fit(tmp_path):
    """`train-draft --init CKPT`: architecture flags beside it are refused by name (before anything loads); the
    settings take the checkpoint's architecture; an EAGLE-3 run cannot continue it; features cached over another
    draft vocabulary are refused."""
    from dataclasses import replace

    from click.testing import CliRunner

    from dspark_export.cli import cli as main
    from dspark_export.drafter.checkpoint import save_checkpoint
    from dspark_export.drafter.init_checkpoint import cached_vocab as _cached_vocab
    from dspark_export.drafter.init_checkpoint import check_reused_data_fits, settings_from_checkpoint
    from dspark_export.drafter.pipeline import PipelineSettings

    def _check_reused_data_fits(pipeline, src):
        return check_reused_data_fits(pipeline, src, PipelineSettings())
    from dspark_runtime.errors import DSparkError

    model = _tiny_drafter()
    save_checkpoint(model, tmp_path / "ckpt")
    r = CliRunner().invoke(main, ["train-draft", "--out", str(tmp_path / "c"), "--init", str(tmp_path / "ckpt"),
                                  "--layers", "2", "--draft-vocab", "8"])
    assert r.exit_code == 2 and "drop --layers, --draft-vocab" in r.output
    c = model.config
    got = settings_from_checkpoint(PipelineSettings(markov_rank=0, num_layers=3), tmp_path / "ckpt")
    assert (got.num_layers, got.markov_rank, got.block_size, got.mask_token_id, got.feature_layers, got.init) == \
        (c.num_hidden_layers, c.markov_rank, c.block_size, c.mask_token_id, tuple(c.target_layer_ids),
         str(tmp_path / "ckpt"))
    with pytest.raises(DSparkError, match="eagle3 run starts from scratch"):
        settings_from_checkpoint(replace(PipelineSettings(), method="eagle3"), tmp_path / "ckpt")
    _check_reused_data_fits({"init": str(tmp_path / "ckpt"), "feature_layers": [-1, 0]}, tmp_path)
    with pytest.raises(DSparkError, match=r"target layers \[1, 13, 25\].*reads layers \[-1, 0\]"):
        _check_reused_data_fits({"init": str(tmp_path / "ckpt"), "feature_layers": [1, 13, 25]}, tmp_path)
    (tmp_path / "f").mkdir()
    np.save(tmp_path / "f" / "draft_vocab.npy", np.arange(8, dtype=np.int64))
    assert _cached_vocab(tmp_path / "f", None, None).tolist() == list(range(8))  # from scratch: the cache's
    with pytest.raises(DSparkError, match="another draft vocabulary"):
        _cached_vocab(tmp_path / "f", np.arange(1, 9, dtype=np.int64), str(tmp_path / "ckpt"))


def test_reuse_source_takes_the_data_settings_and_fills_fields_an_older_run_lacks(tmp_path):
    from dspark_export.drafter.pipeline import DATA_FIELDS, _reuse_source
    from dspark_runtime.errors import DSparkError

    src = {"target": str(tmp_path / "t"), "engine": "e", "out": "o", "train": {},
           "pipeline": {k: 7 for k in DATA_FIELDS if k != "feature_tokens"},  # written before feature_tokens existed
           "stages": {"features": {"done": True}}}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "state.json").write_text(json.dumps(src))
    fresh = {"target": str(tmp_path / "t"), "engine": None, "pipeline": {k: 1 for k in DATA_FIELDS}}
    fresh["pipeline"]["feature_tokens"] = None
    _reuse_source(tmp_path / "run", fresh)
    assert fresh["engine"] == "e" and fresh["pipeline"]["feature_tokens"] is None
    assert all(fresh["pipeline"][k] == 7 for k in DATA_FIELDS if k != "feature_tokens")
    with pytest.raises(DSparkError, match="features of the target .* not "):
        _reuse_source(tmp_path / "run", dict(fresh, target=str(tmp_path / "other")))


def test_training_on_a_gpu_matches_the_cpu_run(tmp_path):
    """``TrainSettings.device``: the CPU run keeps every tensor on the CPU; the same run on CUDA (fp32) moves the
    weights in the same direction and writes its checkpoint. The CUDA half skips without a GPU."""
    import torch

    from dspark_export.drafter.train import TrainSettings, train

    store = _synthetic_store(tmp_path / "features")
    init = {k: v.clone() for k, v in _tiny_drafter().state_dict().items()}
    s = TrainSettings(lr=3e-3, warmup_steps=3, anchors_per_seq=4, epochs=2.0, eval_every=100, eval_seqs=2,
                      time_budget_s=600)
    cpu = _tiny_drafter()
    assert train(store, cpu, None, tmp_path / "cpu", s, gamma=4, mask_token=39, log=lambda *a: None)["finished"]
    assert all(v.device.type == "cpu" for v in cpu.state_dict().values())
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU half of this test needs an NVIDIA GPU")
    s.device = "cuda"
    gpu = _tiny_drafter()
    assert train(store, gpu, None, tmp_path / "gpu", s, gamma=4, mask_token=39, log=lambda *a: None)["finished"]
    d_cpu = torch.cat([(cpu.state_dict()[k] - init[k]).flatten() for k in init if init[k].is_floating_point()])
    d_gpu = torch.cat([(gpu.state_dict()[k].cpu() - init[k]).flatten() for k in init if init[k].is_floating_point()])
    assert float(torch.nn.functional.cosine_similarity(d_cpu, d_gpu, dim=0)) > 0.99
    assert (tmp_path / "gpu" / "model.safetensors").is_file()


def test_answer_prompts_writes_greedy_answers_and_keyed_samples(tiny_pair, tmp_path):
    """``draft_data.answer_prompts`` (the CPU pipeline's and ``scripts/gpu_train_draft.py``'s answer loop): greedy
    records are prompt + the model's own greedy continuation; sampled answers get keys ``key#j``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_export.drafter.data import answer_prompts, done_keys

    target, _ = tiny_pair
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    todo = [("gsm8k", "gsm8k:1", "one two three"), ("mbpp", "mbpp:2", "def f(x): return x")]
    out = tmp_path / "answers.jsonl"
    r = answer_prompts(model, tok, todo, out, max_new_tokens=6, batch_size=2)
    assert r["complete"] and r["prompts"] == 2 and done_keys(out) == {"gsm8k:1", "mbpp:2"}
    rec = json.loads(out.read_text().splitlines()[0])
    prompt = rec["ids"][:rec["prompt_len"]]
    with torch.inference_mode():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              pad_token_id=tok.pad_token_id)[0].tolist()
    while want and want[-1] == tok.pad_token_id and len(want) > len(prompt):
        want.pop()
    assert rec["ids"] == want and len(rec["ids"]) > rec["prompt_len"]
    out2 = tmp_path / "sampled.jsonl"
    torch.manual_seed(0)
    answer_prompts(model, tok, todo[:1], out2, max_new_tokens=6, samples=3, temperature=1.0)
    assert done_keys(out2) == {"gsm8k:1", "gsm8k:1#1", "gsm8k:1#2"}


def test_learning_rate_schedule_warms_up_for_at_most_a_tenth_of_the_run():
    """Linear warmup then cosine to 0: 50 warmup steps in a long run, a tenth of a short one (a 45-step run
    reaches its peak learning rate instead of ending inside the warmup)."""
    s = TrainSettings(lr=1e-3)
    assert s.warmup(558) == 50 and s.warmup(45) == 4 and s.warmup(5) == 1
    short = [s.lr_at(k, 45) for k in range(45)]
    assert max(short) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 45)))
    assert short.index(max(short)) == 3 and short[0] == pytest.approx(1e-3 / 4)
    assert all(a >= b for a, b in zip(short[3:], short[4:])) and s.lr_at(45, 45) == 0.0
    assert s.lr_at(49, 558) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 49 / 558)))
    assert s.lr_at(24, 558) == pytest.approx(1e-3 * 25 / 50 * 0.5 * (1 + math.cos(math.pi * 24 / 558)))


def test_sequences_file_is_read_once_into_views_of_one_array(tmp_path):
    """read_sequences returns each sequence of a sequences.npz as a view of one copy of its arrays (slicing a fresh
    npz[name] per sequence kept a whole array alive per sequence: ~15 GB for a 956k-token run)."""
    from dspark_export.drafter.pipeline import read_sequences

    seqs = [np.arange(a, a + n, dtype=np.int32) for a, n in ((3, 5), (20, 7), (40, 2))]
    np.savez(tmp_path / "sequences.npz", ids=np.concatenate(seqs),
             mask=np.concatenate([np.ones(len(q), np.uint8) for q in seqs]), starts=np.cumsum([0, 5, 7, 2]))
    got = read_sequences(tmp_path / "sequences.npz")
    assert [g[0].tolist() for g in got] == [q.tolist() for q in seqs] and [int(g[1].sum()) for g in got] == [5, 7, 2]
    assert all(g[0].base is got[0][0].base and g[1].base is got[0][1].base for g in got)


def test_engine_features_in_chunks_equal_one_call_per_sequence(int4_engine, tmp_path):
    """extract_features_ort feeds each sequence in calls of ``chunk`` positions over its KV cache (the screened
    head's per-position rows made one call of a long sequence hold gigabytes); the int4 graph is row-invariant, so
    the features and logits are bit for bit those of one call per sequence."""
    from dspark_export.drafter.features import FeatureStore, extract_features_ort

    seqs = [(np.arange(5, 45, dtype=np.int32), np.ones(40, np.uint8)), (np.arange(60, 83, dtype=np.int32),
                                                                          np.ones(23, np.uint8))]
    vocab = np.arange(0, 64, dtype=np.int64)
    got = []
    for chunk in (7, 1 << 20):
        assert extract_features_ort(int4_engine, seqs, tmp_path / str(chunk), vocab, chunk=chunk)["tokens"] == 63
        store = FeatureStore(tmp_path / str(chunk))
        got.append([np.asarray(a) for i in range(2) for a in store.get(i)[2:]])
    assert got[0][0].shape[0] == 40 and all(np.array_equal(a, b) for a, b in zip(*got))


def test_features_on_openvino_are_close_to_the_cpu_graphs_and_the_choice_is_checked(int4_engine, tmp_path):
    """extract_features_ort(provider="openvino") runs the engine's int4 target graph on ONNX Runtime's OpenVINO
    provider: the same shards, features and logits close to the CPU provider's (other numerics: bf16 on AMX); an
    unknown provider is refused, and `train-draft --features-on openvino` without --engine is refused with the fix."""
    from click.testing import CliRunner

    from dspark_export.cli import cli as main
    from dspark_export.drafter.features import FeatureStore, extract_features_ort
    from dspark_runtime.backends.ort_openvino import openvino_cpu_devices
    from dspark_runtime.errors import DSparkError

    seqs = [(np.arange(5, 45, dtype=np.int32), np.ones(40, np.uint8)), (np.arange(50, 80, dtype=np.int32),
                                                                          np.ones(30, np.uint8))]
    vocab = np.arange(0, 64, dtype=np.int64)
    with pytest.raises(DSparkError, match="not 'gpu'"):
        extract_features_ort(int4_engine, seqs, tmp_path / "x", vocab, provider="gpu")
    r = CliRunner().invoke(main, ["train-draft", "--out", str(tmp_path / "c"), "--features-on", "openvino"])
    assert r.exit_code == 2 and "give --engine ENGINE" in r.output
    try:
        openvino_cpu_devices()
    except DSparkError as e:
        pytest.skip(f"no OpenVINO device here: {e}")
    got = {}
    for provider in ("cpu", "openvino"):
        out = tmp_path / provider
        assert extract_features_ort(int4_engine, seqs, out, vocab, provider=provider)["tokens"] == 70
        store = FeatureStore(out)
        got[provider] = [tuple(np.asarray(a, np.float32) for a in store.get(i)[2:]) for i in range(2)]
    for (fc, lc), (fo, lo) in zip(got["cpu"], got["openvino"]):
        assert 0 < np.linalg.norm(fo - fc) / np.linalg.norm(fc) < 0.1  # close, not the same arithmetic
        assert np.mean(lo.argmax(-1) == lc.argmax(-1)) > 0.8


def test_features_on_torch_bf16_come_from_the_hf_weights_beside_the_engines_answers(tiny_engine_dir, tiny_pair,
                                                                                      tmp_path, monkeypatch):
    """`--features-on torch-bf16` with --engine: the answers still come from the engine, the features from the
    target's Hugging Face weights in torch bf16 (final hidden states stored, not the graph's logits), close to the
    engine graph's features but not its arithmetic; the run trains to the end on them."""
    from dspark_export.drafter import data as draft_data
    from dspark_export.drafter.features import FeatureStore, extract_features_ort
    from dspark_export.drafter.pipeline import PipelineSettings, train_draft_pipeline
    from dspark_export.drafter.train import TrainSettings

    prompts = [("mbpp", f"mbpp:{i}", f"Write a function number {i}.") for i in range(1, 3)]
    monkeypatch.setattr(draft_data, "training_prompt_list", lambda n_sharegpt=0, n_code_tasks=0: prompts)
    p = PipelineSettings(answer_tokens=16, answer_batch=2, sharegpt_prompts=0, stdlib_tokens=300, sharegpt_tokens=0,
                         max_seq_len=128, feature_layers=(-1, 0), draft_vocab_size=64, intermediate_size=32,
                         block_size=4, markov_rank=8, features_on="torch-bf16",
                         mask_token_id=json.loads((tiny_pair[0] / "config.json").read_text())["vocab_size"] - 1)
    s = TrainSettings(lr=3e-3, epochs=1.0, eval_seqs=1, anchors_per_seq=4, warmup_steps=2, eval_every=1000)
    work = tmp_path / "work"
    r = train_draft_pipeline(tiny_pair[0], work, tmp_path / "ckpt", p, s, engine_dir=tiny_engine_dir,
                             compile_into_engine=False, log=lambda *a: None)
    assert r["finished"] and r["stages"]["answers"]["new_tokens"] > 0
    store = FeatureStore(work / "features")
    assert store.aux == "last" and not (work / "features" / "draft_vocab.npy").exists()
    ids, mask, feats, _ = store.get(0)
    extract_features_ort(tiny_engine_dir, [(np.asarray(ids), np.asarray(mask))], tmp_path / "graph",
                         np.arange(64, dtype=np.int64))
    ref = np.asarray(FeatureStore(tmp_path / "graph").get(0)[2], np.float32)
    d = np.linalg.norm(np.asarray(feats, np.float32) - ref) / np.linalg.norm(ref)
    assert 1e-3 < d < 0.05  # bf16 products: close to the fp32 graph, not the same arithmetic
