"""The EAGLE-3 drafter at run time (issue 48): the ``eagle3_draft`` graph driven by :class:`Eagle3Drafter` reproduces
DeepSpec's own decoding path (the parity fixture of tests/export/drafter/test_eagle3.py, two rounds through the
ONNX graph); compiled into a copy of the tiny scatter engine (``dspark-export add-draft``) it decodes exactly —
greedy alone, batched and under the router equal target-only, and sampling keeps the target's distribution (a
chi-square test on the first two tokens); what it cannot do is refused by name."""
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.runtime.decoding.test_acceptance import chisquare  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "deepspec_parity" / "eagle3"
PROMPTS = ["hello world", "def f(x):\n    return", "the the the the the the"]


# ------------------------------------------------------------------ DeepSpec parity through the runtime drafter


class FeatureTarget:
    """The verifier runner as the drafter sees it: features and cached lengths per request."""

    def __init__(self, features: np.ndarray):
        self.feats, self.lengths = features, {}

    def features(self, rid):
        return self.feats[: self.lengths[rid]]

    def length(self, rid):
        return self.lengths[rid]


@pytest.fixture(scope="module")
def fixture_graph(tmp_path_factory):
    """(OrtEagle3Graph of DeepSpec's tiny EAGLE-3 checkpoint, its embedding rows)."""
    from dspark_export.drafter.eagle3 import load_eagle3_checkpoint
    from dspark_export.drafter.eagle3_graph import export_eagle3_graph, validate_eagle3_graph
    from dspark_runtime.drafting.embedding_rows import EmbeddingRows
    from dspark_runtime.drafting.eagle3 import OrtEagle3Graph

    out = tmp_path_factory.mktemp("eagle3-graph")
    model = load_eagle3_checkpoint(FIXTURE).eval()
    spec = export_eagle3_graph(model, out / "eagle3.onnx")
    validate_eagle3_graph(model, out / "eagle3.onnx")
    table = model.embed_tokens.weight.detach().float().numpy()
    table.tofile(out / "embed.bin")
    rows = EmbeddingRows(out / "embed.bin", 0, "float32", table.shape)
    return OrtEagle3Graph(out / "eagle3.onnx", spec, threads=1, embedding=rows), rows


def _recording(graph):
    """Wrap ``graph.run`` to keep every call's logits."""
    calls = []
    run = graph.run

    def rec(*a):
        out = run(*a)
        calls.append(out[1].copy())
        return out

    graph.run = rec
    return calls


def test_runtime_drafter_reproduces_deepspecs_rounds(fixture_graph):
    """Round 1 drafts from the prompt's 6 positions; the verifier accepts 2 drafts plus DeepSpec's bonus token;
    round 2 drafts from position 9: tokens equal DeepSpec's, logits within fp32 noise."""
    from dspark_runtime.decoding.sampling import SamplingParams
    from dspark_runtime.drafting.eagle3 import Eagle3Drafter

    graph, _ = fixture_graph
    with np.load(FIXTURE / "reference.npz") as z:
        ref = {k: z[k] for k in z.files}
    target = FeatureTarget(ref["features"][0])
    drafter = Eagle3Drafter(graph, target)
    req = SimpleNamespace(rid=0, prompt=ref["prompt"].tolist(), out=[int(ref["first_token"])],
                          params=SamplingParams(), rng=np.random.default_rng(0))
    target.lengths[0] = len(req.prompt)
    drafter.begin(req)
    calls = _recording(graph)
    try:
        for r in range(2):
            calls.clear()
            (prop,) = drafter.propose_batch([req], [3])
            assert prop.tokens == ref[f"r{r}_tokens"].tolist(), r
            assert prop.q is None and prop.survival is None
            logits = np.concatenate([c for c in calls])
            assert np.abs(logits - ref[f"r{r}_logits"]).max() < 5e-5, r
            req.out += prop.tokens[: int(ref["accept"])] + [int(ref["bonus"])]
            target.lengths[0] = len(req.prompt) + len(req.out) - 1
    finally:
        del graph.run


def test_batched_rows_draft_as_alone(fixture_graph):
    """Two requests at different lengths in one pass (one just joined with its prompt, one mid-decode) draft what
    each drafts alone."""
    from dspark_runtime.decoding.sampling import SamplingParams
    from dspark_runtime.drafting.eagle3 import Eagle3Drafter

    graph, _ = fixture_graph
    feats = np.random.default_rng(1).standard_normal((20, 160)).astype(np.float32)

    def make(rid, n_prompt, out):
        return SimpleNamespace(rid=rid, prompt=list(range(3, 3 + n_prompt)), out=list(out), params=SamplingParams(),
                               rng=np.random.default_rng(rid))

    def alone(rid, n_prompt, outs):
        t = FeatureTarget(feats)
        d = Eagle3Drafter(graph, t)
        r = make(rid, n_prompt, outs[0])
        t.lengths[rid] = n_prompt
        d.begin(r)
        got = []
        for o in outs:
            r.out = list(o)
            t.lengths[rid] = n_prompt + len(o) - 1
            got.append(d.propose_batch([r], [3])[0].tokens)
        return got

    a_outs, b_outs = [[5], [5, 6, 7]], [[9, 10, 11, 12], [9, 10, 11, 12, 13]]
    ref_a, ref_b = alone(0, 4, a_outs), alone(1, 9, b_outs)
    t = FeatureTarget(feats)
    d = Eagle3Drafter(graph, t)
    ra, rb = make(0, 4, a_outs[0]), make(1, 9, b_outs[0])
    for r, n in ((ra, 4), (rb, 9)):
        t.lengths[r.rid] = n
        d.begin(r)
    got_a, got_b = [], []
    for oa, ob in zip(a_outs, b_outs):
        ra.out, rb.out = list(oa), list(ob)
        t.lengths[0], t.lengths[1] = 4 + len(oa) - 1, 9 + len(ob) - 1
        pa, pb = d.propose_batch([ra, rb], [3, 2])
        got_a.append(pa.tokens)
        got_b.append(pb.tokens)
    assert got_a == ref_a
    assert got_b == [t[:2] for t in ref_b]


# --------------------------------------------------------------------------------- the tiny engine


@pytest.fixture(scope="module")
def eagle3_engine_dir(tiny_scatter_engine_dir, tiny_pair, tiny_feature_store, tmp_path_factory):
    """(engine dir, checkpoint): a copy of the tiny scatter engine (target features of layers -1, 0) with a tiny
    EAGLE-3 drafter fusing layer 0 (3 steps a round), trained 300 steps on the tiny target's features, added as graph
    ``eagle3``."""
    from dspark_export.engine_dir.add_eagle3 import add_eagle3_draft
    from tests.fixtures.tiny_models import make_tiny_eagle3

    root = tmp_path_factory.mktemp("engines-eagle3")
    out = root / "tiny"
    shutil.copytree(tiny_scatter_engine_dir, out)
    ckpt = make_tiny_eagle3(root / "eagle3-ckpt", tiny_pair[0], train_store=tiny_feature_store, steps=300)
    add_eagle3_draft(out, ckpt, isolate=False, log=lambda *a: None, precision="fp32")
    return out, ckpt


@pytest.fixture(scope="module")
def eagle3_engine(eagle3_engine_dir):
    from dspark_runtime.engine import Engine

    return Engine.load(eagle3_engine_dir[0], threads=1)


def test_add_draft_records_the_drafter(eagle3_engine_dir):
    engine_dir, _ = eagle3_engine_dir
    m = json.loads((engine_dir / "manifest.json").read_text())
    e3 = m["speculation"]["eagle3"]
    assert e3["graph"] == "eagle3" and e3["target_layer_ids"] == [0] and e3["ttt_length"] == 3
    assert e3["embedding"]["file"] == "target.onnx.data"  # the target's own table: no copy
    g = m["graphs"]["eagle3"]
    assert g["spec"]["kind"] == "eagle3_draft" and g["validation"]["fp32"]["argmax_agreement"] == 1.0
    assert "dspark" in m["graphs"] and "draft" in m["graphs"]  # the other drafters stay


def test_greedy_eagle3_and_router_equal_target_only(eagle3_engine):
    eng = eagle3_engine
    assert eng.drafters.graphs_used("eagle3") == ["target", "eagle3"]
    accepted = 0
    for prompt in PROMPTS:
        ref = eng.generate(prompt, max_new_tokens=32, draft="none")
        for gamma in (None, 1, 5):
            got = eng.generate(prompt, max_new_tokens=32, draft="eagle3", draft_length=gamma)
            assert got.token_ids == ref.token_ids, (prompt, gamma)
            assert got.stats.drafter == "eagle3" and got.stats.proposed > 0
            accepted += got.stats.accepted
            if gamma is None:  # ttt_length is the default γ
                assert got.stats.proposed <= 3 * got.stats.num_rounds
    assert accepted > 0  # the trained drafter's tokens are accepted: the checks above see real verification
    refs = [eng.generate(p, max_new_tokens=24, draft="none").token_ids for p in PROMPTS]
    got = eng.generate_batch(PROMPTS, max_new_tokens=24, draft="eagle3", max_batch=3)
    assert [r.token_ids for r in got] == refs


def test_router_over_eagle3_when_the_engine_has_no_dspark_drafter(eagle3_engine_dir, tmp_path):
    """An engine whose model drafters are a draft LM and EAGLE-3: draft='router' runs n-gram lookup or EAGLE-3
    per round, exactly (the draft LM is the router's model drafter only where it is the engine's only one)."""
    from dspark_export.engine_dir.commit import write_manifest
    from dspark_runtime.engine import Engine
    from dspark_runtime.engine_dir.manifest import load_manifest

    out = tmp_path / "tiny"
    shutil.copytree(eagle3_engine_dir[0], out)
    m = load_manifest(out, verify=False)
    m.graphs.pop("dspark")
    m.speculation.dspark = None
    write_manifest(m, out)
    eng = Engine.load(out, threads=1)
    assert eng.drafters.draft_kind == "eagle3"
    ref = eng.generate(PROMPTS[2], max_new_tokens=32, draft="none")
    got = eng.generate(PROMPTS[2], max_new_tokens=32, draft="router")
    assert got.token_ids == ref.token_ids
    assert set(got.stats.draft_sources) == {"ngram", "eagle3"}


def test_router_chooses_among_ngram_dspark_and_eagle3(eagle3_engine):
    """The engine has both model drafters: draft='router' picks per request and round the one whose learned
    acceptance promises most (the untrained DSpark drafter's falls once its blocks are rejected) or the n-gram
    continuation, exactly; every source's rounds add up."""
    eng = eagle3_engine
    router = eng.batch(draft="router").drafter
    assert list(router.models) == ["dspark", "eagle3"] and router.reads_target_features
    used = set()
    for prompt in PROMPTS:
        ref = eng.generate(prompt, max_new_tokens=32, draft="none")
        got = eng.generate(prompt, max_new_tokens=32, draft="router")
        assert got.token_ids == ref.token_ids, prompt
        src = got.stats.draft_sources
        assert set(src) == {"ngram", "dspark", "eagle3"}
        assert sum(v["rounds"] for v in src.values()) == got.stats.num_rounds
        assert sum(v["accepted"] for v in src.values()) == got.stats.accepted
        used |= {k for k, v in src.items() if v["rounds"]}
    assert {"dspark", "eagle3"} <= used
    refs = [eng.generate(p, max_new_tokens=24, draft="none").token_ids for p in PROMPTS]
    got = eng.generate_batch(PROMPTS, max_new_tokens=24, draft="router", max_batch=3)
    assert [r.token_ids for r in got] == refs


def two_token_law_pvalue(eng, prompt: str, runs: int = 1500) -> float:
    """Chi-square p-value of the first two tokens' joint law under sampled EAGLE-3 drafting (temperature 1, top-k 3,
    γ 3; one seed per run) against the exact target law from the target-only logits. Fails at once on a pair the
    target forbids; asserts every expected count >= 5."""
    from dspark_runtime.decoding.sampling import SamplingParams, process_logits

    params = SamplingParams(temperature=1.0, top_k=3)
    ids = eng.encode_prompt(prompt)
    runner = eng.runner("target")

    def dist(tokens):
        runner.reset()
        return process_logits(np.asarray(runner.prefill(tokens), dtype=np.float32), params)

    p1 = dist(ids)
    exact = {(a, b): p1[a] * pb for a in np.flatnonzero(p1) for b, pb in enumerate(dist(ids + [int(a)])) if pb > 0}
    counts = dict.fromkeys(exact, 0)
    for seed in range(runs):
        r = eng.generate(prompt, max_new_tokens=2, temperature=1.0, top_k=3, seed=seed, draft="eagle3",
                         draft_length=3)
        key = tuple(r.token_ids[:2])
        assert key in counts, key  # a pair the target forbids
        counts[key] += 1
    keys = sorted(exact)
    expected = np.array([exact[k] for k in keys]) * runs
    assert expected.min() >= 5
    return chisquare(np.array([counts[k] for k in keys]), expected)[1]


def test_sampled_eagle3_keeps_the_target_distribution(eagle3_engine):
    """Temperature 1, top-k 3: the joint law of the first two tokens under EAGLE-3 drafting (rejection sampling)
    against the exact target law computed from the target-only logits (:func:`two_token_law_pvalue`)."""
    assert two_token_law_pvalue(eagle3_engine, PROMPTS[1]) > 1e-3


def test_what_it_cannot_do_is_refused_by_name(eagle3_engine, tiny_scatter_engine_dir, eagle3_engine_dir, tmp_path):
    from dspark_export.engine_dir.add_eagle3 import add_eagle3_draft
    from dspark_runtime.engine import Engine
    from dspark_runtime.errors import DSparkError, InputError

    with pytest.raises(InputError, match="draft_confidence .*not implemented for the EAGLE-3 drafter"):
        eagle3_engine.generate("hi", max_new_tokens=4, draft="eagle3", draft_confidence=0.5)
    with pytest.raises(InputError, match="draft_length='scheduled' needs the DSpark drafter"):
        eagle3_engine.generate("hi", max_new_tokens=4, draft="eagle3", draft_length="scheduled")
    with pytest.raises(InputError, match="no EAGLE-3 drafter; add one with `dspark-export add-draft"):
        Engine.load(tiny_scatter_engine_dir, threads=1).generate("hi", max_new_tokens=4, draft="eagle3")
    # a drafter reading a layer the target graph does not output: refused before anything is written
    out = tmp_path / "tiny"
    shutil.copytree(tiny_scatter_engine_dir, out)
    before = (out / "manifest.json").read_text()
    cfg = json.loads((eagle3_engine_dir[1] / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(eagle3_engine_dir[1], bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "target_layer_ids": [0, 1], "num_target_layers": None}))
    with pytest.raises(DSparkError, match=r"reads target layers \[0, 1\] .* outputs features of layers \[-1, 0\] only "
                                          r"\(missing \[1\]\); rebuild the target"):
        add_eagle3_draft(out, bad, isolate=False, log=lambda *a: None)
    assert (out / "manifest.json").read_text() == before
