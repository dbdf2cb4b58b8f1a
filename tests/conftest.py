import os

import pytest

# The CLI and the scripts run every ONNX Runtime session on one process-wide thread pool
# (dspark_runtime.backends.ort.enable_shared_thread_pool), after which plain sessions in the same process are refused;
# the tests make such sessions in-process, so the suite keeps per-session pools (tests/runtime/test_thread_pool.py runs
# the shared pool in a subprocess).
os.environ.setdefault("DSPARK_SHARED_THREAD_POOL", "0")


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir): tiny random Qwen2 models sharing a byte-level BPE tokenizer."""
    pytest.importorskip("torch")
    from tests.fixtures.tiny_models import make_pair

    return make_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_graph(tiny_pair, tmp_path_factory):
    """(graph path, GraphSpec, calibration token lists) of the tiny target exported with features
    (tests/export/precision/test_quantize.py, tests/export/precision/test_fp8.py; read only)."""
    import numpy as np

    from dspark_export.graphs.decoder import decoder_dims, export_decoder, load_hf_model

    root = tmp_path_factory.mktemp("qgraph")
    model = load_hf_model(tiny_pair[0])
    spec = export_decoder(model, decoder_dims(model.config, (-1, 0)), root / "g.onnx")
    rng = np.random.default_rng(0)
    return root / "g.onnx", spec, [list(map(int, rng.integers(3, 300, 24))) for _ in range(3)]


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_pair, tmp_path_factory):
    """An engine directory built from the tiny pair (in-process export)."""
    from dspark_export.engine_dir.build import Recipe, build_engine

    tdir, ddir = tiny_pair
    out = tmp_path_factory.mktemp("engines") / "tiny"
    build_engine(Recipe(name="tiny", target=str(tdir), draft=str(ddir), target_feature_layers=[-1, 0],
                        draft_length=4), out, isolate=False, log=lambda *a: None)
    return out


@pytest.fixture(scope="session")
def tiny_engine_with_dspark(tiny_engine_dir, tiny_pair, tmp_path_factory):
    """A copy of the tiny engine with an untrained DSpark drafter added as graph ``dspark`` (fp32, block 4) beside
    its draft LM: target, draft and DSpark drafter graphs in one engine (read only; copy it to change it)."""
    import shutil

    from tests.fixtures.tiny_models import add_tiny_dspark

    out = tmp_path_factory.mktemp("engines-dspark") / "tiny"
    shutil.copytree(tiny_engine_dir, out)
    add_tiny_dspark(out, tiny_pair[0])
    return out


@pytest.fixture(scope="session")
def tiny_scatter_engine_dir(tiny_pair, tmp_path_factory):
    """The tiny pair built fp32 in the scatter KV layout (cached positions can be imported: n choices, the prefix
    cache), draft length 3, with its draft LM and an untrained DSpark drafter as graph ``dspark`` (read only)."""
    from dspark_export.engine_dir.build import Recipe, build_engine
    from tests.fixtures.tiny_models import add_tiny_dspark

    tdir, ddir = tiny_pair
    out = tmp_path_factory.mktemp("engines-scatter") / "tiny"
    build_engine(Recipe(name="tiny", target=str(tdir), draft=str(ddir), precision="fp32", kv_layout="scatter",
                        target_feature_layers=[-1, 0], draft_length=3, calibration_prompts=2), out,
                 isolate=False, log=lambda *a: None)
    add_tiny_dspark(out, tdir)
    return out


@pytest.fixture(scope="session")
def tiny_feature_store(tiny_pair, tmp_path_factory):
    """A FeatureStore of the tiny target's features (layers -1, 0) and final states over 48 of its own greedy
    continuations of random 8-token prompts (the prompts not trained on)."""
    pytest.importorskip("torch")
    import numpy as np
    import torch

    from dspark_export.drafter.features import FeatureStore, extract_features
    from transformers import AutoModelForCausalLM

    tdir, _ = tiny_pair
    root = tmp_path_factory.mktemp("tiny-features")
    target = AutoModelForCausalLM.from_pretrained(tdir).eval()
    rng = np.random.default_rng(0)
    seqs = []
    with torch.no_grad():
        for _ in range(48):
            p = torch.as_tensor(rng.integers(3, 300, size=(1, 8)))
            out = target.generate(p, max_new_tokens=56, do_sample=False, eos_token_id=None, pad_token_id=0)
            ids = out[0].numpy().astype(np.int32)
            m = np.zeros(len(ids), np.uint8)
            m[8:] = 1
            seqs.append((ids, m))
    del target
    extract_features(tdir, seqs, root / "features", [-1, 0], shard_tokens=1024, dtype="float32")
    return FeatureStore(root / "features")


@pytest.fixture(scope="session")
def tiny_dspark(tiny_pair, tiny_feature_store, tmp_path_factory):
    """(engine_dir, checkpoint_dir, train_report) for a tiny DSpark drafter trained ~20 s on the tiny target."""
    pytest.importorskip("torch")
    import json

    import torch

    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_export.drafter.features import choose_draft_vocab
    from dspark_export.drafter.train import TrainSettings, train
    from dspark_export.drafter.model import DSparkDraftModel, qwen2_draft_config
    from dspark_export.drafter.graph import target_frozen_weights

    tdir, _ = tiny_pair
    root = tmp_path_factory.mktemp("dspark")
    store = tiny_feature_store
    cfg = json.loads((tdir / "config.json").read_text())
    vocab = choose_draft_vocab(store.token_counts(cfg["vocab_size"]), 200, always=[2])
    c = qwen2_draft_config(cfg, mask_token_id=cfg["vocab_size"] - 1, num_layers=1, intermediate_size=64,
                           block_size=4, target_layer_ids=(-1, 0), markov_rank=16, draft_vocab_size=len(vocab))
    torch.manual_seed(0)
    model = DSparkDraftModel(c)
    model.draft_vocab_ids.copy_(torch.as_tensor(vocab))
    emb, head = target_frozen_weights(tdir)
    model.init_from_target(emb, head)
    ckpt = root / "ckpt"
    rep = train(store, model, head[model.draft_vocab_ids], ckpt,
                TrainSettings(lr=3e-3, time_budget_s=600, max_steps=250, eval_every=1000, eval_seqs=6,
                              anchors_per_seq=16, warmup_steps=10),
                gamma=c.block_size, mask_token=c.mask_token_id, log=lambda *a: None)
    # as `dspark-export calibrate` writes it: STS temperatures and the router's priors (build copies both)
    (ckpt / "sts.json").write_text(json.dumps({"temperatures": [1.0, 1.0, 1.0, 1.0], "router": {
        "ngram": {"edges": [1, 2, 3], "hits": [[2, 1], [6, 4], [9, 8]], "tries": [[10, 2], [10, 6], [10, 9]]},
        "inner": {"dspark": {"hits": [[3, 1, 0, 0]], "tries": [[10, 3, 1, 0]]}}}}))
    out = root / "engine"
    build_engine(Recipe(name="tiny-dspark", target=str(tdir), draft=f"dspark:{ckpt}"), out, isolate=False,
                 log=lambda *a: None)
    return out, ckpt, rep


_TRT_BUILDS: list = []


@pytest.fixture(scope="session")
def trt_build_log():
    """Tests append (label, TrtEngineEntry or build dict) for each TensorRT engine they build; the summary
    below prints them, so every CI log shows which engines TensorRT built, how big, how fast."""
    return _TRT_BUILDS


def pytest_terminal_summary(terminalreporter):
    if not _TRT_BUILDS:
        return
    terminalreporter.section("TensorRT engines built in this run (ahead of time, no GPU)")
    for label, e in _TRT_BUILDS:
        get = (lambda k: getattr(e, k)) if not isinstance(e, dict) else e.get
        size = e.file.size if not isinstance(e, dict) else None
        terminalreporter.write_line(
            f"{label:40s} {get('flavour')} {get('version')} {get('precision'):5s} "
            f"cc {','.join(get('compute_capabilities')):16s} "
            + (f"{size / 1e6:5.1f} MB " if size else "") +
            f"build {get('build_seconds'):5.2f} s  peak RSS {get('peak_rss_bytes') / 2**20:6.0f} MiB")


@pytest.fixture(scope="session")
def int4_engine(tiny_pair, tmp_path_factory):
    """The tiny pair built int4 (scatter KV layout) with its prompt graph added (read only)."""
    from dspark_export.engine_dir.add_prompt_graph import add_prompt_graph
    from dspark_export.engine_dir.build import Recipe, build_engine

    tdir, ddir = tiny_pair
    out = tmp_path_factory.mktemp("engines-prompt") / "tiny"
    build_engine(Recipe(name="tiny", target=str(tdir), draft=str(ddir), precision="int4", target_feature_layers=[-1, 0],
                        draft_length=3), out, isolate=False, log=lambda *a: None)
    add_prompt_graph(out, log=lambda *a: None)
    return out
