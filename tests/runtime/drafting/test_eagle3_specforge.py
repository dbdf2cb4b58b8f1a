"""A SpecForge-layout EAGLE-3 drafter at run time: a reduced draft vocabulary (:class:`DraftVocab`) maps the graph's
logits columns to target ids; the runtime drafter's tokens equal the torch model's (mapped) and its sampled q is zero
outside the draft vocabulary. Compiled into a copy of the tiny scatter engine (``add_eagle3_draft``; its embedding
rows are the target graph's, the checkpoint holding none), greedy decoding equals target-only, every drafted token
is a draft-vocabulary target id, and sampling keeps the target's distribution (chi-square on the first two tokens)."""
import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.export.drafter.test_eagle3_specforge import (random_specforge, specforge_config,  # noqa: E402
                                                        vocab_tensors, write_specforge_checkpoint)
from tests.runtime.drafting.test_eagle3_drafter import PROMPTS, FeatureTarget  # noqa: E402

DRAFT_VOCAB = 192  # of the tiny target's 320 tokens, the most frequent in its own continuations (SpecForge's rule)


# ------------------------------------------------------------------------------- the vocabulary map


def test_draft_vocab_maps_columns_to_target_ids():
    from dspark_runtime.decoding.sampling import SamplingParams, process_logits
    from dspark_runtime.drafting.eagle3 import DraftVocab
    from dspark_runtime.errors import ManifestError

    v = DraftVocab(np.array([2, 5, 7]), 10)
    assert [v.to_target(i) for i in range(3)] == [2, 5, 7]
    full = v.full(np.array([1.0, 3.0, 2.0], np.float32))
    assert full[[2, 5, 7]].tolist() == [1.0, 3.0, 2.0] and np.isneginf(np.delete(full, [2, 5, 7])).all()
    q = process_logits(full, SamplingParams(temperature=1.0))
    assert abs(q.sum() - 1) < 1e-6 and (np.delete(q, [2, 5, 7]) == 0).all() and int(q.argmax()) == 5
    for bad in ([5, 2], [0, 10], [[1, 2]], [], np.array([1.0, 2.0])):
        with pytest.raises(ManifestError, match=r"strictly increasing int64 target ids in 0\.\.9"):
            DraftVocab(np.asarray(bad), 10)


def test_engine_vocabulary_entry_is_checked(tmp_path):
    from dspark_runtime.drafting.eagle3 import eagle3_vocab
    from dspark_runtime.engine_dir.graphspec import DecoderDims, eagle3_draft_spec
    from dspark_runtime.engine_dir.speculation import Eagle3Section
    from dspark_runtime.errors import ManifestError

    emb = {"file": "t.bin", "offset": 0, "dtype": "float32", "shape": [10, 4]}
    spec = eagle3_draft_spec(DecoderDims(1, 1, 4, 4, 3), 8)
    full = Eagle3Section.from_json({"graph": "eagle3", "target_layer_ids": [0], "ttt_length": 3, "embedding": emb})
    with pytest.raises(ManifestError, match=r"logits cover 3 tokens, the target's vocabulary 10, and "
                                            r"speculation.eagle3 names no draft_vocab_file"):
        eagle3_vocab(tmp_path, full, spec, 10)
    assert eagle3_vocab(tmp_path, full, eagle3_draft_spec(DecoderDims(1, 1, 4, 4, 10), 8), 10) is None
    sec = Eagle3Section.from_json({**full.to_json(), "draft_vocab_file": "v.npy"})
    assert sec.to_json()["draft_vocab_file"] == "v.npy" and "draft_vocab_file" not in full.to_json()
    with pytest.raises(ManifestError, match=r"v.npy: the EAGLE-3 draft vocabulary .* cannot be read"):
        eagle3_vocab(tmp_path, sec, spec, 10)
    np.save(tmp_path / "v.npy", np.array([1, 4, 6, 8], np.int64))
    with pytest.raises(ManifestError, match=r"4 draft token ids for the 3 logits"):
        eagle3_vocab(tmp_path, sec, spec, 10)
    np.save(tmp_path / "v.npy", np.array([1, 4, 6], np.int64))
    assert eagle3_vocab(tmp_path, sec, spec, 10).ids.tolist() == [1, 4, 6]


# ------------------------------------------------------------------ the runtime drafter against torch


@pytest.fixture(scope="module")
def sf_graph(tmp_path_factory):
    """(OrtEagle3Graph of a random SpecForge checkpoint with its DraftVocab, the torch model)."""
    from dspark_export.drafter.eagle3 import load_eagle3_checkpoint
    from dspark_export.drafter.eagle3_graph import export_eagle3_graph
    from dspark_runtime.drafting.embedding_rows import EmbeddingRows
    from dspark_runtime.drafting.eagle3 import DraftVocab, OrtEagle3Graph

    out = tmp_path_factory.mktemp("sf-graph")
    folder, ids, _ = random_specforge(out / "ckpt", layer_ids=[1, 5, 8], seed=2)
    model = load_eagle3_checkpoint(folder).eval()
    spec = export_eagle3_graph(model, out / "eagle3.onnx")
    table = model.embed_tokens.weight.detach().float().numpy()
    table.tofile(out / "embed.bin")
    rows = EmbeddingRows(out / "embed.bin", 0, "float32", table.shape)
    return OrtEagle3Graph(out / "eagle3.onnx", spec, threads=1, embedding=rows, draft_vocab=DraftVocab(ids, 97)), model


def _request(rid, prompt, out, temperature=0.0, seed=0):
    from dspark_runtime.decoding.sampling import SamplingParams

    return SimpleNamespace(rid=rid, prompt=list(prompt), out=list(out), params=SamplingParams(temperature=temperature),
                           rng=np.random.default_rng(seed))


def test_runtime_drafts_equal_torch_mapped_to_target_ids(sf_graph):
    """Two rounds (prefill of 6 positions, then 3 more committed): the runtime's greedy drafts are the torch model's
    argmax over the draft vocabulary mapped through d2t, fed back as target ids."""
    from dspark_export.drafter.eagle3 import Eagle3Cache
    from dspark_runtime.drafting.eagle3 import Eagle3Drafter

    graph, model = sf_graph
    feats = np.random.default_rng(4).standard_normal((20, 72)).astype(np.float32)
    target = FeatureTarget(feats)
    drafter = Eagle3Drafter(graph, target)
    req = _request(0, [3, 14, 15, 92, 65, 35], [89])
    target.lengths[0] = 6
    drafter.begin(req)
    cache, done = Eagle3Cache(), 0
    vocab = set(graph.draft_vocab.ids.tolist())
    for _ in range(2):
        p = len(req.prompt) + len(req.out) - 1
        (prop,) = drafter.propose_batch([req], [3])
        seq = req.prompt + req.out
        with torch.no_grad():
            state = model.extend(torch.from_numpy(feats[None, done:p]), torch.tensor([seq[done + 1: p + 1]]),
                                 torch.arange(done, p)[None], cache)
            _, _, tok = model.greedy_draft(state, p, cache, steps=3)
        assert prop.tokens == tok[0].tolist() and set(prop.tokens) <= vocab and prop.q is None
        done = p
        req.out += [prop.tokens[0], 7, 11]  # one draft accepted, then two other tokens
        target.lengths[0] = len(req.prompt) + len(req.out) - 1


def test_sampled_q_is_zero_outside_the_draft_vocabulary(sf_graph):
    """A sampled request's q: the processed full-vocabulary row of the torch model's draft logits, -inf outside the
    draft vocabulary (so zero there), and the drafted tokens are drawn inside it."""
    from dspark_export.drafter.eagle3 import Eagle3Cache
    from dspark_runtime.decoding.sampling import process_logits
    from dspark_runtime.drafting.eagle3 import Eagle3Drafter

    graph, model = sf_graph
    ids = graph.draft_vocab.ids
    feats = np.random.default_rng(5).standard_normal((20, 72)).astype(np.float32)
    target = FeatureTarget(feats)
    drafter = Eagle3Drafter(graph, target)
    req = _request(1, [3, 14, 15, 92, 65], [35], temperature=1.0, seed=3)
    target.lengths[1] = 5
    drafter.begin(req)
    (prop,) = drafter.propose_batch([req], [3])
    assert prop.q.shape == (3, 97) and np.allclose(prop.q.sum(-1), 1, atol=1e-5)
    assert (np.delete(prop.q, ids, axis=1) == 0).all() and (prop.q[:, ids] > 0).all()
    assert all(int(t) in set(ids.tolist()) and prop.q[k, t] > 0 for k, t in enumerate(prop.tokens))
    with torch.no_grad():
        state = model.extend(torch.from_numpy(feats[None, :5]), torch.tensor([[14, 15, 92, 65, 35]]),
                             torch.arange(5)[None], Eagle3Cache())
        first = model.logits(state)[0, 0].numpy()
    assert np.abs(prop.q[0] - process_logits(graph.draft_vocab.full(first), req.params)).max() < 1e-5


# --------------------------------------------------------------------------------- the tiny engine


def make_specforge_drafter(folder: Path, target_dir: Path, store, steps: int = 300) -> Path:
    """A SpecForge-layout drafter for the tiny target: one Llama layer (no q/k norms) fusing target layers (-1, 0),
    trained ``steps`` steps on ``store`` with a full-vocabulary head, then saved as SpecForge's exporter saves it:
    ``midlayer.*``, the head's rows of the DRAFT_VOCAB most frequent tokens with d2t/t2d, no embed_tokens (frozen:
    the target's is used), bf16."""
    from dspark_export.drafter.eagle3 import Eagle3DraftModel, eagle3_config_for
    from dspark_export.drafter.eagle3_train import train_eagle3
    from dspark_export.drafter.features import choose_draft_vocab
    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.drafter.train import TrainSettings

    t = json.loads((Path(target_dir) / "config.json").read_text())
    c = dataclasses.replace(eagle3_config_for(t, [0], ttt_length=3), target_layer_ids=[-1, 0], qk_norm=False)
    assert c.rope_parameters["rope_type"] == "default" and c.hidden_act == "silu"
    torch.manual_seed(0)
    model = Eagle3DraftModel(c)
    emb, head = target_frozen_weights(target_dir)
    model.init_from_target(emb, head)
    train_eagle3(store, model, head.detach().clone(), folder / "training", log=lambda *a: None,
                 s=TrainSettings(lr=1e-2, time_budget_s=600, max_steps=steps, eval_every=10 ** 6, eval_seqs=6,
                                 warmup_steps=10, seqs_per_step=2))
    ids = choose_draft_vocab(store.token_counts(c.vocab_size), DRAFT_VOCAB)
    sd = {k: v.detach() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v.to(torch.bfloat16)
               for k, v in sd.items()}
    tensors["lm_head.weight"] = tensors["lm_head.weight"][torch.from_numpy(ids)]
    tensors.update(vocab_tensors(ids, c.vocab_size))
    cfg = specforge_config(c.vocab_size, DRAFT_VOCAB, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                           c.head_dim, c.intermediate_size, c.rope_parameters["rope_theta"], c.rms_norm_eps,
                           layer_ids=[-1, 0])
    return write_specforge_checkpoint(folder / "specforge", cfg, tensors)


@pytest.fixture(scope="module")
def sf_engine_dir(tiny_scatter_engine_dir, tiny_pair, tiny_feature_store, tmp_path_factory):
    """(engine dir, checkpoint): a copy of the tiny scatter engine with the SpecForge drafter as graph ``eagle3``."""
    from dspark_export.engine_dir.add_eagle3 import add_eagle3_draft

    root = tmp_path_factory.mktemp("engines-eagle3-specforge")
    out = root / "tiny"
    shutil.copytree(tiny_scatter_engine_dir, out)
    ckpt = make_specforge_drafter(root / "ckpt", tiny_pair[0], tiny_feature_store)
    add_eagle3_draft(out, ckpt, isolate=False, log=lambda *a: None, precision="fp32")
    return out, ckpt


@pytest.fixture(scope="module")
def sf_engine(sf_engine_dir):
    from dspark_runtime.engine import Engine

    return Engine.load(sf_engine_dir[0], threads=1)


@pytest.fixture
def drafted(monkeypatch):
    """Every proposal the EAGLE-3 drafter makes in the test: [(tokens, q)]."""
    from dspark_runtime.drafting.eagle3 import Eagle3Drafter

    seen, propose = [], Eagle3Drafter.propose_batch

    def spy(self, reqs, gammas, only=None):
        props = propose(self, reqs, gammas, only)
        seen.extend((p.tokens, p.q) for p in props)
        return props

    monkeypatch.setattr(Eagle3Drafter, "propose_batch", spy)
    return seen


def test_add_draft_records_the_vocabulary_and_the_targets_table(sf_engine_dir):
    engine_dir, ckpt = sf_engine_dir
    m = json.loads((engine_dir / "manifest.json").read_text())
    e3, g = m["speculation"]["eagle3"], m["graphs"]["eagle3"]
    assert e3["target_layer_ids"] == [-1, 0] and e3["ttt_length"] == 7  # SpecForge's default --ttt-length
    assert e3["embedding"]["file"] == "target.onnx.data"  # no embed_tokens in the checkpoint: the target's table
    assert e3["draft_vocab_file"] == "eagle3_draft_vocab.npy"
    assert "eagle3_draft_vocab.npy" in [f["path"] for f in g["files"]]
    assert g["spec"]["dims"]["vocab_size"] == DRAFT_VOCAB and g["validation"]["fp32"]["argmax_agreement"] == 1.0
    assert g["model_config"]["architectures"] == ["LlamaForCausalLMEagle3"]
    d2t = torch.from_numpy(np.load(engine_dir / e3["draft_vocab_file"]))
    from safetensors.torch import load_file
    t = load_file(str(ckpt / "model.safetensors"))
    assert torch.equal(d2t, torch.arange(DRAFT_VOCAB) + t["d2t"])


def test_greedy_equals_target_only_with_drafts_inside_the_vocabulary(sf_engine, sf_engine_dir, drafted):
    eng = sf_engine
    vocab = set(np.load(sf_engine_dir[0] / "eagle3_draft_vocab.npy").tolist())
    accepted = 0
    for prompt in PROMPTS:
        ref = eng.generate(prompt, max_new_tokens=32, draft="none")
        for gamma in (None, 3):
            got = eng.generate(prompt, max_new_tokens=32, draft="eagle3", draft_length=gamma)
            assert got.token_ids == ref.token_ids, (prompt, gamma)
            assert got.stats.drafter == "eagle3" and got.stats.proposed > 0
            accepted += got.stats.accepted
    tokens = [t for toks, _ in drafted for t in toks]
    assert tokens and set(tokens) <= vocab
    assert accepted > 0  # the trained drafter's mapped tokens are accepted: real verification
    refs = [eng.generate(p, max_new_tokens=24, draft="none").token_ids for p in PROMPTS]
    got = eng.generate_batch(PROMPTS, max_new_tokens=24, draft="eagle3", max_batch=3)
    assert [r.token_ids for r in got] == refs


def test_sampled_eagle3_keeps_the_target_distribution(sf_engine, sf_engine_dir, drafted):
    """Temperature 1, top-k 3: the first two tokens' joint law with SpecForge-vocabulary drafts (q zero outside the
    draft vocabulary) against the exact target law; every q is zero outside the draft vocabulary. (The drafter is
    weak on this prompt, so the chi-square alone has little power against a wrong q; q itself is checked against
    torch in test_sampled_q_is_zero_outside_the_draft_vocabulary.)"""
    from tests.runtime.drafting.test_eagle3_drafter import two_token_law_pvalue

    ids = np.load(sf_engine_dir[0] / "eagle3_draft_vocab.npy")
    assert two_token_law_pvalue(sf_engine, PROMPTS[1]) > 1e-3
    qs = [q for _, q in drafted if q is not None]
    assert qs and all((np.delete(q, ids, axis=1) == 0).all() for q in qs)
    assert set(t for toks, _ in drafted for t in toks) <= set(ids.tolist())


def test_a_drafter_for_another_target_is_refused(tiny_scatter_engine_dir, tmp_path):
    """Fused states of another width, or another vocabulary: refused before anything is written."""
    from dspark_export.engine_dir.add_eagle3 import add_eagle3_draft
    from dspark_runtime.errors import DSparkError

    out = tmp_path / "tiny"
    shutil.copytree(tiny_scatter_engine_dir, out)
    before = (out / "manifest.json").read_text()
    wide, _, _ = random_specforge(tmp_path / "wide", n_layers=2, layer_ids=[-1, 0])  # target_hidden_size 24
    with pytest.raises(DSparkError, match=r"fuses target states 24 wide over a vocabulary of 97, but the engine's "
                                          r"target has hidden size 64"):
        add_eagle3_draft(out, wide, isolate=False, log=lambda *a: None)
    assert (out / "manifest.json").read_text() == before
