"""DeepSpec's DFlash drafters end to end (issue 48): a DSpark drafter without the Markov and confidence heads
(markov_rank 0, enable_confidence_head false) saved in DeepSpec's layout, compiled into a copy of the tiny scatter
engine (``dspark-export add-draft``), decodes exactly with fixed verify lengths and with the router; what needs the
confidence head (scheduled verify lengths of the DSpark drafter alone, a confidence threshold) is refused by name,
and ``dspark info`` says DFlash. The loader and graph parity against DeepSpec's reference forward are in
tests/export/drafter/test_deepspec_compat.py (DFLASH)."""
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

PROMPTS = ["hello world", "def f(x):\n    return", "the the the the the the"]


@pytest.fixture(scope="module")
def dflash_engine_dir(tiny_scatter_engine_dir, tiny_pair, tmp_path_factory):
    """(engine dir, checkpoint dir): a copy of the tiny scatter engine whose DSpark drafter (graph ``dspark``) is
    replaced by an untrained tiny DFlash drafter (block 4)."""
    from tests.fixtures.tiny_models import add_tiny_dspark

    out = tmp_path_factory.mktemp("engines-dflash") / "tiny"
    shutil.copytree(tiny_scatter_engine_dir, out)
    ckpt = add_tiny_dspark(out, tiny_pair[0], markov_rank=0, confidence_head=False)
    return out, ckpt


@pytest.fixture(scope="module")
def dflash_engine(dflash_engine_dir):
    from dspark_runtime.engine import Engine

    return Engine.load(dflash_engine_dir[0], threads=1)


def test_checkpoint_has_deepspecs_dflash_layout_and_the_manifest_no_heads(dflash_engine_dir):
    from safetensors import safe_open

    engine_dir, ckpt = dflash_engine_dir
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["markov_rank"] == 0 and cfg["enable_confidence_head"] is False
    assert "markov_head_type" not in cfg and "confidence_head_with_markov" not in cfg  # as DeepSpec writes it
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if k.startswith(("markov_head.", "confidence_head."))]
    ds = json.loads((engine_dir / "manifest.json").read_text())["speculation"]["dspark"]
    assert ds["graph"] == "dspark" and ds["markov_rank"] == 0 and ds["confidence_head"] is False
    assert not ds.get("markov_head_type") and not ds.get("confidence_head_with_markov")
    with np.load(engine_dir / ds["heads_file"]) as z:
        assert z.files == []


def test_greedy_dflash_and_router_equal_target_only(dflash_engine):
    eng = dflash_engine
    drafter = eng.batch(draft="dspark").drafter
    assert not drafter.confident and drafter.heads.w1 is None
    for prompt in PROMPTS:
        ref = eng.generate(prompt, max_new_tokens=32, draft="none")
        for draft, gamma in (("dspark", 3), ("dspark", 1), ("router", None)):
            got = eng.generate(prompt, max_new_tokens=32, draft=draft, draft_length=gamma)
            assert got.token_ids == ref.token_ids, (prompt, draft, gamma)
            assert got.stats.drafter == draft and got.stats.proposed > 0, (prompt, draft, got.stats)
    refs = [eng.generate(p, max_new_tokens=24, draft="none").token_ids for p in PROMPTS]
    for draft in ("dspark", "router"):
        got = eng.generate_batch(PROMPTS, max_new_tokens=24, draft=draft, draft_length=3, max_batch=3)
        assert [r.token_ids for r in got] == refs, draft


def test_what_needs_the_confidence_head_is_refused_by_name(dflash_engine):
    """Scheduled verify lengths of the DSpark drafter alone and a confidence threshold need the confidence head; the
    router schedules from learned acceptance (as over a draft LM), so it stays available and exact."""
    from dspark_runtime.errors import InputError

    eng = dflash_engine
    spec = eng.manifest.speculation
    saved = spec.cost_table
    assert not saved  # unprofiled: the missing head is named before the missing cost table
    with pytest.raises(InputError, match="draft_length='scheduled' with draft='dspark'.*no confidence head"):
        eng.generate("hi", max_new_tokens=4, draft="dspark", draft_length="scheduled")
    spec.cost_table = {"tokens": [1, 32], "seconds": [1.0, 1.0]}  # any table: the check comes before decoding
    try:
        with pytest.raises(InputError, match="draft_length='scheduled' with draft='dspark'.*no confidence head"):
            eng.generate("hi", max_new_tokens=4, draft="dspark", draft_length="scheduled")
        ref = eng.generate(PROMPTS[1], max_new_tokens=24, draft="none")
        got = eng.generate(PROMPTS[1], max_new_tokens=24, draft="router", draft_length="scheduled")
        assert got.token_ids == ref.token_ids and got.stats.drafter == "router"
    finally:
        spec.cost_table = saved
    for draft in ("dspark", "router"):
        with pytest.raises(InputError, match="draft_confidence .*no confidence head"):
            eng.generate("hi", max_new_tokens=4, draft=draft, draft_confidence=0.5)
    from dspark_runtime.engine_dir.speculation import manifest_schedulable

    spec.dspark.sts_temperatures, spec.cost_table = [1.0] * 4, {"tokens": [1, 2], "seconds": [1.0, 1.0]}
    try:  # even with temperatures and a table, auto never schedules a drafter without a confidence head
        assert not manifest_schedulable(eng.manifest)
    finally:
        spec.dspark.sts_temperatures, spec.cost_table = None, saved


def test_info_says_dflash(dflash_engine_dir, capsys):
    from dspark_runtime.cli import main

    try:
        main(["info", "--engine", str(dflash_engine_dir[0])])
    except SystemExit as e:
        assert not e.code, capsys.readouterr().err
    line = next(l for l in capsys.readouterr().out.splitlines() if "DSpark drafter:" in l)
    assert "DFlash (Markov rank 0, no confidence head" in line, line


def test_calibrate_fits_the_routers_priors_without_temperatures(dflash_engine_dir, tmp_path):
    """`dspark-export calibrate` on a DFlash engine: no confidences to calibrate, so no STS temperatures, but the
    router's priors (n-gram and the drafter's acceptance by position) are fitted from its decoding rounds."""
    from dspark_export.fit.calibrate_drafter import calibrate_engine
    from dspark_runtime.engine_dir.manifest import load_manifest

    eng_dir = tmp_path / "tiny"
    shutil.copytree(dflash_engine_dir[0], eng_dir)
    res = calibrate_engine(eng_dir, n_prompts=2, max_new_tokens=24, log=lambda *a: None)
    assert res["temperatures"] is None and res["report"] == [] and res["rounds"] > 0
    m = load_manifest(eng_dir)
    assert m.speculation.dspark.sts_temperatures is None
    counts = m.speculation.router["inner"]["dspark"]
    assert m.speculation.router["gamma"] == 4 and counts["tries"][0][0] == res["rounds"]  # every round tries position 1
