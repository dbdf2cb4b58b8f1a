"""Real models (slow; run with `pytest -m slow` after `bash scripts/quickstart.sh`).

They skip with a reason when the models or engines are absent, so the default suite never
downloads anything."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QWEN_ENGINE = ROOT / "engines" / "qwen2.5-coder-1.5b"

pytestmark = pytest.mark.slow


def _link_or_copy(src, dst):
    """A hard link (the engine copies of the slow tests share the big files), else a copy."""
    import os
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _humaneval(n):
    lines = (ROOT / "dspark_export" / "data" / "prompts" / "humaneval.jsonl").read_text().splitlines()[:n]
    return [json.loads(l)["turns"][0] for l in lines]


@pytest.fixture(scope="module")
def smollm_engine(tmp_path_factory):
    pytest.importorskip("torch")
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_export.models.catalog import model_path
    from dspark_export.paths import resolve_recipe

    if not (model_path("smollm2-135m-instruct") / "config.json").is_file():
        pytest.skip("smollm2-135m-instruct not fetched: run `dspark-export fetch smollm2-135m-instruct`")
    prebuilt = ROOT / "engines" / "smollm2-135m"
    if (prebuilt / "manifest.json").is_file():
        out = prebuilt
    else:
        out = tmp_path_factory.mktemp("eng") / "smollm2"
        build_engine(Recipe.from_file(resolve_recipe("smollm2-135m")), out, isolate=True)
    from dspark_runtime import Engine

    return Engine.load(out)


def test_smollm2_speculative_equals_target_only(smollm_engine):
    for prompt in _humaneval(2):
        ref = smollm_engine.generate(prompt, max_new_tokens=48, draft=None)
        for gamma in (2, 5, "auto"):
            spec = smollm_engine.generate(prompt, max_new_tokens=48, draft_length=gamma)
            assert spec.token_ids == ref.token_ids
        assert "def " in ref.text  # a real model writes code for a code prompt


def test_smollm2_sampled_runs_and_is_reproducible(smollm_engine):
    p = _humaneval(1)[0]
    a = smollm_engine.generate(p, max_new_tokens=32, temperature=0.7, top_p=0.95, seed=3)
    b = smollm_engine.generate(p, max_new_tokens=32, temperature=0.7, top_p=0.95, seed=3)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


@pytest.mark.skipif(not (QWEN_ENGINE / "manifest.json").is_file(),
                    reason="Qwen engine not built: run `bash scripts/quickstart.sh` first")
def test_qwen_pair_speculative_equals_target_only():
    from dspark_runtime import Engine

    eng = Engine.load(QWEN_ENGINE)
    for prompt in _humaneval(2):
        ref = eng.generate(prompt, max_new_tokens=48, draft=None)
        spec = eng.generate(prompt, max_new_tokens=48, draft="lm")
        assert spec.token_ids == ref.token_ids
        assert spec.stats.accepted_length_mean > 1.5  # the 0.5B draft agrees often with the 1.5B
        if eng.dspark_graph is not None:  # the DSpark drafter compiled beside it (scripts/quickstart.sh)
            ds = eng.generate(prompt, max_new_tokens=48, draft="dspark")
            assert ds.token_ids == ref.token_ids
            assert ds.stats.accepted > 0


@pytest.mark.skipif(not (QWEN_ENGINE / "manifest.json").is_file(),
                    reason="Qwen engine not built: run `bash scripts/quickstart.sh` first")
def test_qwen_pair_with_an_eagle3_drafter_equals_target_only(tmp_path):
    """An EAGLE-3 drafter for Qwen2.5-Coder-1.5B fusing the engine's feature layers (1, 13, 25), its weights
    untrained (the target's embedding and LM head, the rest random: what is checked is exactness and the int4 graph,
    not acceptance), compiled into a copy of the engine (files hard-linked) by `add_eagle3_draft`: greedy EAGLE-3
    output equals target-only output at γ 3 and 7."""
    pytest.importorskip("torch")
    import shutil

    import torch

    from dspark_export.drafter.eagle3 import Eagle3DraftModel, eagle3_config_for, save_eagle3_checkpoint
    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.engine_dir.add_eagle3 import add_eagle3_draft
    from dspark_export.models.catalog import model_path
    from dspark_runtime import Engine

    tdir = model_path("qwen2.5-coder-1.5b-instruct")
    torch.manual_seed(0)
    model = Eagle3DraftModel(eagle3_config_for(json.loads((tdir / "config.json").read_text()), [1, 13, 25], 7))
    model.init_from_target(*target_frozen_weights(tdir))
    ckpt = save_eagle3_checkpoint(model, tmp_path / "eagle3-ckpt")
    del model

    eng_dir = tmp_path / "engine"
    shutil.copytree(QWEN_ENGINE, eng_dir, copy_function=_link_or_copy)
    add_eagle3_draft(eng_dir, ckpt, isolate=True, log=lambda *a: None)
    m = json.loads((eng_dir / "manifest.json").read_text())
    assert m["graphs"]["eagle3"]["precision"] == "int4" and m["speculation"]["eagle3"]["target_layer_ids"] == [1, 13, 25]
    assert (eng_dir / "eagle3.onnx.data").stat().st_size < 300e6  # the full-vocabulary head quantized too
    eng = Engine.load(eng_dir)
    for prompt in _humaneval(2):
        ref = eng.generate(prompt, max_new_tokens=32, draft=None)
        for gamma in (3, 7):
            spec = eng.generate(prompt, max_new_tokens=32, draft="eagle3", draft_length=gamma)
            assert spec.token_ids == ref.token_ids, gamma
            assert spec.stats.proposed > 0


@pytest.mark.skipif(not (QWEN_ENGINE / "manifest.json").is_file(),
                    reason="Qwen engine not built: run `bash scripts/quickstart.sh` first")
def test_qwen_pair_with_a_dflash_drafter_equals_target_only(tmp_path):
    """A DFlash drafter (DeepSpec's: the DSpark model with Markov rank 0 and no confidence head) for
    Qwen2.5-Coder-1.5B fusing the engine's feature layers, untrained (exactness, not acceptance), compiled int4 into
    a hard-linked copy of the engine in place of its DSpark drafter: greedy output equals target-only, alone and
    under the router."""
    pytest.importorskip("torch")
    import shutil

    import torch

    from dspark_export.drafter.checkpoint import save_checkpoint
    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.drafter.model import DSparkDraftModel, qwen2_draft_config
    from dspark_export.engine_dir.add_draft import add_dspark_draft
    from dspark_export.models.catalog import model_path
    from dspark_runtime import Engine

    tdir = model_path("qwen2.5-coder-1.5b-instruct")
    cfg = json.loads((tdir / "config.json").read_text())
    c = qwen2_draft_config(cfg, mask_token_id=cfg["vocab_size"] - 1, num_layers=1, intermediate_size=1024,
                           block_size=7, target_layer_ids=(1, 13, 25), markov_rank=0, confidence_head=False)
    torch.manual_seed(0)
    model = DSparkDraftModel(c)
    model.init_from_target(*target_frozen_weights(tdir))
    ckpt = save_checkpoint(model, tmp_path / "dflash-ckpt", dtype=torch.float32)
    del model

    eng_dir = tmp_path / "engine"
    shutil.copytree(QWEN_ENGINE, eng_dir, copy_function=_link_or_copy)
    add_dspark_draft(eng_dir, ckpt, "qwen2.5-coder-1.5b-instruct", log=lambda *a: None)
    m = json.loads((eng_dir / "manifest.json").read_text())
    assert m["speculation"]["dspark"]["markov_rank"] == 0 and m["speculation"]["dspark"]["confidence_head"] is False
    eng = Engine.load(eng_dir)
    for prompt in _humaneval(2):
        ref = eng.generate(prompt, max_new_tokens=32, draft=None)
        for draft in ("dspark", "router"):
            spec = eng.generate(prompt, max_new_tokens=32, draft=draft, draft_length=7)
            assert spec.token_ids == ref.token_ids, draft
            assert spec.stats.proposed > 0 or draft == "router"
