"""End to end on tiny models: train a DSpark drafter on target features, compile it with the target,
and decode with it — greedy output must equal target-only greedy output."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def dspark_engine(tiny_dspark):
    from dspark_runtime.engine import Engine

    return Engine.load(tiny_dspark[0], threads=1)


def test_training_learns_something(tiny_dspark):
    rep = tiny_dspark[2]
    # the held-out teacher-forced greedy acceptance at position 1 is far above chance (1/200)
    assert rep["heldout_acc_pos"][0] > 0.15, rep  # chance is 1/200
    assert rep["heldout_tau_greedy"] > 1.2, rep


def test_manifest_records_the_drafter(tiny_dspark):
    m = json.loads((tiny_dspark[0] / "manifest.json").read_text())
    spec = m["speculation"]
    assert spec["draft_kind"] == "dspark" and spec["draft_length"] == 4
    assert spec["dspark"]["target_layer_ids"] == [-1, 0] and spec["dspark"]["draft_vocab_size"] == 200
    assert m["graphs"]["draft"]["spec"]["kind"] == "dspark_draft"
    assert m["graphs"]["target"]["spec"]["dims"]["feature_layers"] == [-1, 0]
    assert {f["path"] for f in m["graphs"]["draft"]["files"]} >= {"draft.onnx", "dspark_heads.npz"}
    assert m["graphs"]["draft"]["validation"]["fp32"]["argmax_agreement"] == 1.0


def test_drafter_graph_reads_the_anchor_row_from_the_target_table(tiny_dspark, tiny_pair):
    """No [V, d] embedding table in the drafter graph: the anchor's row comes from the target graph's own external
    data (the manifest says where), equal to the target's embedding; a truncated table is refused by name."""
    import onnx

    from dspark_runtime.drafting.embedding_rows import EmbeddingRows
    from dspark_runtime.errors import DSparkError

    engine_dir = tiny_dspark[0]
    m = json.loads((engine_dir / "manifest.json").read_text())
    emb = m["speculation"]["dspark"]["embedding"]
    vocab = m["graphs"]["target"]["spec"]["dims"]["vocab_size"]
    hidden = m["graphs"]["target"]["spec"]["dims"]["hidden_size"]
    assert emb["file"] == "target.onnx.data" and emb["dtype"] == "float32" and emb["shape"] == [vocab, hidden]
    g = onnx.load(str(engine_dir / "draft.onnx"), load_external_data=False).graph
    assert not [t.name for t in g.initializer if list(t.dims) == [vocab, hidden]]
    assert [i.name for i in g.input][2] == "anchor_embeds"
    rows = EmbeddingRows.from_manifest(engine_dir, emb).rows(np.array([[5], [7]]))
    from dspark_export.drafter.graph import target_frozen_weights

    ref = target_frozen_weights(tiny_pair[0])[0].float().numpy()
    assert rows.shape == (2, 1, hidden) and np.array_equal(rows[:, 0], ref[[5, 7]])
    with pytest.raises(DSparkError, match="shorter than"):
        EmbeddingRows(engine_dir / "dspark_heads.npz", 0, "float32", (vocab, hidden))
    with pytest.raises(DSparkError, match="outside"):
        EmbeddingRows.from_manifest(engine_dir, emb).rows(np.array([[vocab]]))


def test_quantizing_the_target_keeps_the_drafter_embedding(tiny_dspark, tmp_path):
    """`dspark-export quantize` rewrites target.onnx.data: the drafter's embedding entry follows the table to its
    new offset (the same rows), and the quantized engine's speculative output equals its target-only output."""
    from dspark_export.precision.quantize import quantize_engine
    from dspark_runtime.drafting.embedding_rows import EmbeddingRows
    from dspark_runtime.engine import Engine

    src = tiny_dspark[0]
    old = json.loads((src / "manifest.json").read_text())["speculation"]["dspark"]["embedding"]
    m = quantize_engine(src, tmp_path / "q", "target=int4,draft=fp32", int4_source="rtn", log=lambda *a: None)
    new = m.speculation.dspark.embedding
    from dspark_export.drafter.graph import target_embedding_entry

    assert new == target_embedding_entry(tmp_path / "q", "target.onnx") and new["file"] == "target.onnx.data"
    ids = np.arange(0, old["shape"][0], 7)[:, None]
    assert np.array_equal(EmbeddingRows.from_manifest(tmp_path / "q", new).rows(ids),
                          EmbeddingRows.from_manifest(src, old).rows(ids))
    eng = Engine.load(tmp_path / "q", threads=1)
    ref = eng.generate("hello world", max_new_tokens=24, draft=None)
    spec = eng.generate("hello world", max_new_tokens=24, draft="dspark", draft_length=4)
    assert spec.token_ids == ref.token_ids and spec.stats.accepted > 0


def test_int4_drafter_graph_is_smaller_and_exact(tiny_dspark, tiny_pair, tmp_path):
    """`add-draft --precision int4`: the drafter graph's MatMuls become MatMulNBits (weights ~1/6), the quantized
    graph is compared with the fp32 one, and speculative greedy output still equals target-only."""
    import shutil

    import onnx

    from dspark_export.engine_dir.add_draft import add_dspark_draft
    from dspark_runtime.engine import Engine

    eng_dir = tmp_path / "e"
    shutil.copytree(tiny_dspark[0], eng_dir)
    fp32_bytes = (eng_dir / "draft.onnx.data").stat().st_size
    m = add_dspark_draft(eng_dir, tiny_dspark[1], str(tiny_pair[0]), isolate=False, log=lambda *a: None,
                         precision="int4")
    g = m.graphs["draft"]
    assert g.precision == "int4" and g.quantization["matmul_nbits"] > 0
    assert g.validation["int4"]["argmax_agreement"] > 0.5
    ops = {n.op_type for n in onnx.load(str(eng_dir / "draft.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops and not (eng_dir / "draft.fp32.onnx").exists()
    assert (eng_dir / "draft.onnx.data").stat().st_size < fp32_bytes
    eng = Engine.load(eng_dir, threads=1)
    for prompt in ("hello world", "def f(x):\n    return"):
        ref = eng.generate(prompt, max_new_tokens=24, draft=None)
        out = eng.generate(prompt, max_new_tokens=24, draft="dspark", draft_length=4)
        assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("prompt", ["hello world", "def f(x):\n    return", "the the the the"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_dspark_greedy_equals_target_only(dspark_engine, prompt, gamma):
    ref = dspark_engine.generate(prompt, max_new_tokens=40, draft="none")
    got = dspark_engine.generate(prompt, max_new_tokens=40, draft="dspark", draft_length=gamma)
    assert got.token_ids == ref.token_ids
    assert got.stats.drafter == "dspark"
    assert got.stats.num_rounds < len(got.token_ids) or got.stats.accepted == 0


def test_dspark_accepts_drafts(dspark_engine):
    """The trained drafter's tokens are accepted often enough to shorten decoding (τ > 1)."""
    res = [dspark_engine.generate(p, max_new_tokens=48, draft="dspark") for p in ("abc def", "xyz 123", "hello")]
    assert all(r.stats.drafter == "dspark" for r in res)
    acc = sum(r.stats.accepted for r in res)
    assert acc > 0
    assert np.mean([r.stats.accepted_length_mean for r in res]) > 1.2


def test_dspark_sampling_is_seeded(dspark_engine):
    a = dspark_engine.generate("hello", max_new_tokens=30, temperature=1.0, seed=7, draft="dspark")
    b = dspark_engine.generate("hello", max_new_tokens=30, temperature=1.0, seed=7, draft="dspark")
    assert a.token_ids == b.token_ids


def test_confidence_threshold_cuts_blocks_and_stays_exact(dspark_engine):
    ref = dspark_engine.generate("hello world", max_new_tokens=40, draft="none")
    full = dspark_engine.generate("hello world", max_new_tokens=40, draft="dspark")
    cut = dspark_engine.generate("hello world", max_new_tokens=40, draft="dspark", draft_confidence=0.999)
    assert cut.token_ids == ref.token_ids == full.token_ids
    assert cut.stats.proposed < full.stats.proposed


def test_deepspec_threshold_rule_is_offered_and_exact(dspark_engine):
    """draft_confidence_rule='deepspec' (DeepSpec's own cut: a position's own confidence) reaches the DSpark drafter,
    stays exact, and cuts other blocks than ours at the same threshold; other drafters refuse it by name."""
    from dspark_runtime.errors import InputError

    ref = dspark_engine.generate("hello world", max_new_tokens=40, draft="none")
    ours = dspark_engine.generate("hello world", max_new_tokens=40, draft="dspark", draft_confidence=0.5)
    theirs = dspark_engine.generate("hello world", max_new_tokens=40, draft="dspark", draft_confidence=0.5,
                                    draft_confidence_rule="deepspec")
    assert theirs.token_ids == ours.token_ids == ref.token_ids
    for draft, inner in (("dspark", lambda d: d), ("router", lambda d: d.inner)):
        gen = dspark_engine.batch(draft=draft, draft_confidence=0.5, draft_confidence_rule="deepspec")
        assert inner(gen.drafter).threshold_rule == "deepspec"
    assert theirs.stats.proposed != ours.stats.proposed  # the rules differ (product of survivals vs own confidence)
    with pytest.raises(InputError, match="DSpark drafter only"):
        dspark_engine.generate("hi", max_new_tokens=4, draft="ngram", draft_confidence_rule="deepspec")
    with pytest.raises(InputError, match="unknown draft_confidence_rule"):
        dspark_engine.generate("hi", max_new_tokens=4, draft="dspark", draft_confidence_rule="first")


def test_bad_dspark_checkpoint_path_is_named(tiny_pair, tmp_path):
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_runtime.errors import DSparkError

    with pytest.raises(DSparkError, match="DSpark checkpoint .* not found"):
        build_engine(Recipe(name="x", target=str(tiny_pair[0]), draft=f"dspark:{tmp_path / 'nope'}"),
                     tmp_path / "e", isolate=False, log=lambda *a: None)


def test_lm_draft_on_a_dspark_engine_is_refused(dspark_engine):
    from dspark_runtime.errors import InputError

    with pytest.raises(InputError, match="no draft LM|has no"):
        dspark_engine.generate("hi", max_new_tokens=4, draft="lm")


def test_profile_scheduled_and_calibrate(tiny_dspark, tmp_path):
    """profile -> cost table in the manifest; 'scheduled' verify lengths stay exact; calibrate writes STS
    temperatures fitted on recorded rounds."""
    import shutil

    from dspark_export.fit.calibrate_drafter import calibrate_engine
    from dspark_export.fit.cost_profile import profile_engine
    from dspark_runtime.engine import Engine
    from dspark_runtime.errors import InputError

    eng_dir = tmp_path / "eng"
    shutil.copytree(tiny_dspark[0], eng_dir)
    table = profile_engine(eng_dir, max_tokens=5, context=32, repeats=2, threads=1)
    assert table["tokens"] == [1, 2, 3, 4, 5] and table["drafter"] == "dspark"
    assert all(s >= table["t_draft"] > 0 for s in table["seconds"])
    m = json.loads((eng_dir / "manifest.json").read_text())
    assert m["speculation"]["cost_table"]["tokens"] == [1, 2, 3, 4, 5]

    eng = Engine.load(eng_dir, threads=1)
    # calibrated with its checkpoint (sts.json) and now profiled: auto schedules (a draft length given: fixed)
    assert eng.auto_draft() == "router"
    assert eng.batch(draft="auto").mode == "scheduled" and eng.batch(draft="auto", draft_length=3).mode == "fixed"
    ref = eng.generate("hello world", max_new_tokens=40, draft="none")
    got = eng.generate("hello world", max_new_tokens=40, draft="dspark", draft_length="scheduled")
    assert got.token_ids == ref.token_ids
    assert set(int(k) for k in got.stats.draft_length_histogram) <= set(range(0, 5))

    # the drafter's checkpoint folder, as a copy the engine points at: calibrate leaves its sts.json as it is
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dspark[1], ckpt)
    m = json.loads((eng_dir / "manifest.json").read_text())
    m["graphs"][m["speculation"]["dspark"]["graph"]]["model_id"] = f"dspark:{ckpt}"
    (eng_dir / "manifest.json").write_text(json.dumps(m))
    shipped_sts = (ckpt / "sts.json").read_bytes()
    res = calibrate_engine(eng_dir, n_prompts=3, max_new_tokens=24, log=lambda *a: None)
    assert res["checkpoint_sts"] is None and (ckpt / "sts.json").read_bytes() == shipped_sts
    # profiled: what the measured survivals are worth here (dspark_runtime/scheduling/breakeven.py)
    w = res["worth"]
    assert 1 <= w["verify_length"] <= 4 and w["speedup"] > 0
    assert w["breakeven_alpha"] is None or 0 < w["breakeven_alpha"] <= 1
    assert len(res["temperatures"]) == 4 and all(t > 0 for t in res["temperatures"])
    assert res["rounds"] > 0 and [r["position"] for r in res["report"]] == [1, 2, 3, 4]
    m = json.loads((eng_dir / "manifest.json").read_text())
    assert m["speculation"]["dspark"]["sts_temperatures"] == res["temperatures"]
    # the router's priors: n-gram acceptance on the same greedy outputs, DSpark's per-position acceptance
    router = m["speculation"]["router"]
    assert router["sequences"] == 3 and router["gamma"] == 4
    tries = np.asarray(router["ngram"]["tries"])
    assert tries.shape == (6, 16) and router["ngram"]["matched"] > 0 and tries[:, 0].sum() == router["ngram"]["matched"]
    inner = router["inner"]["dspark"]
    assert inner["tries"][0][0] == res["rounds"]  # every recorded round tests position 1
    # --save-to-checkpoint: the fit goes into the checkpoint's sts.json too, for engines compiled from it later
    saved = calibrate_engine(eng_dir, n_prompts=3, max_new_tokens=24, log=lambda *a: None, save_to_checkpoint=True)
    assert saved["checkpoint_sts"] == str(ckpt / "sts.json")
    sts = json.loads((ckpt / "sts.json").read_text())
    assert sts["temperatures"] == saved["temperatures"] and sts["rounds"] == saved["rounds"] > 0
    assert sts["router"]["inner"]["dspark"] == saved["router"]["inner"]["dspark"]
    eng = Engine.load(eng_dir, threads=1)
    drafter = eng.batch(draft="router").drafter
    np.testing.assert_allclose(drafter.inner_stats.prior_hits[0, 0] / drafter.inner_stats.prior_tries[0, 0],
                               inner["hits"][0][0] / inner["tries"][0][0])
    assert drafter.confidence.prior_tries[:, 0].max() <= 32 + 1e-9  # scaled to at most 32 pseudo-rounds
    assert eng.generate("hello world", max_new_tokens=40, draft="router").token_ids == ref.token_ids
    auto = eng.generate("hello world", max_new_tokens=40)
    assert auto.token_ids == ref.token_ids and auto.stats.drafter == "router"
    m["speculation"]["router"]["ngram"] = {"edges": [1, 2]}
    (eng_dir / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(InputError, match="speculation.router is malformed"):
        Engine.load(eng_dir, threads=1).batch(draft="router")


def test_scheduled_needs_a_cost_table(dspark_engine):
    from dspark_runtime.errors import InputError

    with pytest.raises(InputError, match="dspark-export profile"):
        dspark_engine.generate("hi", max_new_tokens=4, draft="dspark", draft_length="scheduled")
    with pytest.raises(InputError, match="needs the DSpark drafter"):
        dspark_engine.generate("hi", max_new_tokens=4, draft="ngram", draft_length="scheduled")
