"""The DSpark drafter's MoE FFN option (our extension, ``draft_moe_*`` config fields): config checks, routing
against a per-token reference loop, the load-balancing loss, checkpoints, the ONNX graph and a tiny engine."""
import copy
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dspark_export.drafter.checkpoint import expected_shapes, load_checkpoint, save_checkpoint  # noqa: E402
from dspark_export.drafter.config import DraftConfigError, DSparkConfig  # noqa: E402
from dspark_export.drafter.families import MOE_FIELDS  # noqa: E402
from dspark_export.drafter.ffn import DraftMLP, DraftMoE  # noqa: E402
from dspark_export.drafter.model import DSparkDraftModel, qwen2_draft_config  # noqa: E402
from tests.export.drafter.test_deepspec_compat import GEMMA, block_inputs, ours  # noqa: E402
from tests.export.drafter.test_model import DEEPSPEC_CONFIG, _random_model  # noqa: E402

MOE = {"draft_moe_experts": 8, "draft_moe_top_k": 2, "draft_moe_intermediate_size": 24}
QWEN_MOE = dict(DEEPSPEC_CONFIG, **MOE)


def _moe_model(cfg=QWEN_MOE, seed=0, gate_scale=10.0) -> DSparkDraftModel:
    """Random weights (std 0.1) with a sharper router (std 0.1·gate_scale), so routing differs by token."""
    m = _random_model(cfg, seed)
    with torch.no_grad():
        for layer in m.layers:
            layer.mlp.gate.weight.mul_(gate_scale)
    return m.eval()


# --- config ---------------------------------------------------------------------------------------------------

def test_moe_fields_parse_and_round_trip():
    c = DSparkConfig.from_dict(QWEN_MOE)
    assert c.moe and (c.draft_moe_experts, c.draft_moe_top_k, c.draft_moe_intermediate_size) == (8, 2, 24)
    d = c.to_dict()
    assert d == QWEN_MOE  # the config as read, MoE fields included
    back = DSparkConfig.from_dict(d)
    assert (back.draft_moe_experts, back.draft_moe_top_k, back.draft_moe_intermediate_size) == (8, 2, 24)
    # the model follows: every layer's FFN is the MoE, Mixtral-like tensor names, no dense MLP tensors
    m = DSparkDraftModel(c)
    assert all(isinstance(layer.mlp, DraftMoE) and len(layer.mlp.experts) == 8 for layer in m.layers)
    shapes = expected_shapes(c)
    assert shapes["layers.1.mlp.gate.weight"] == (8, 32)
    assert shapes["layers.0.mlp.experts.7.gate_proj.weight"] == (24, 32)
    assert shapes["layers.0.mlp.experts.7.up_proj.weight"] == (24, 32)
    assert shapes["layers.0.mlp.experts.7.down_proj.weight"] == (32, 24)
    assert not any(n.endswith("mlp.gate_proj.weight") for n in shapes)
    assert set(shapes) == set(m.state_dict())
    assert sum(".mlp." in n for n in shapes) == 2 * (1 + 8 * 3)


def test_dense_config_round_trips_unchanged():
    c = DSparkConfig.from_dict(DEEPSPEC_CONFIG)
    assert not c.moe and c.draft_moe_experts == 0 and c.draft_moe_top_k is None
    assert json.dumps(c.to_dict(), indent=2) == json.dumps(DEEPSPEC_CONFIG, indent=2)  # no MoE field written
    assert isinstance(DSparkDraftModel(c).layers[0].mlp, DraftMLP)
    # an explicit 0 is the dense MLP too (and is not written back)
    c0 = DSparkConfig.from_dict(dict(DEEPSPEC_CONFIG, draft_moe_experts=0))
    assert not c0.moe and "draft_moe_experts" not in c0.to_dict()
    assert expected_shapes(c0) == expected_shapes(c)


def test_moe_on_the_gemma4_layer_beside_the_targets_own_moe_fields():
    """The prefixed names never collide with a target's own (Gemma-4's num_experts / top_k_experts / ...)."""
    cfg = dict(GEMMA, **MOE)
    assert cfg["num_experts"] is None and cfg["enable_moe_block"] is False  # the target's, untouched
    c = DSparkConfig.from_dict(cfg)
    assert c.moe and c.gemma and c.to_dict() == cfg
    assert isinstance(DSparkDraftModel(c).layers[1].mlp, DraftMoE)


def test_qwen2_draft_config_moe_arguments():
    target = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
              "hidden_act": "silu", "tie_word_embeddings": False}
    dense = qwen2_draft_config(target, mask_token_id=299, target_layer_ids=(0, 2))
    assert not dense.moe and not set(MOE_FIELDS) & set(dense.to_dict())
    c = qwen2_draft_config(target, mask_token_id=299, target_layer_ids=(0, 2), intermediate_size=96, moe_experts=8)
    assert (c.draft_moe_experts, c.draft_moe_top_k, c.draft_moe_intermediate_size) == (8, 2, 48)  # 96 // 2
    c = qwen2_draft_config(target, mask_token_id=299, target_layer_ids=(0, 2), moe_experts=4, moe_top_k=1)
    assert (c.draft_moe_experts, c.draft_moe_top_k, c.draft_moe_intermediate_size) == (4, 1, 256)
    c = qwen2_draft_config(target, mask_token_id=299, target_layer_ids=(0, 2), moe_experts=8, moe_top_k=3,
                           moe_intermediate_size=40)
    assert (c.draft_moe_experts, c.draft_moe_top_k, c.draft_moe_intermediate_size) == (8, 3, 40)
    assert {k: c.to_dict()[k] for k in MOE_FIELDS} == {"draft_moe_experts": 8, "draft_moe_top_k": 3,
                                                       "draft_moe_intermediate_size": 40}
    with pytest.raises(DraftConfigError, match="'draft_moe_top_k' must be an integer in 1..8"):
        qwen2_draft_config(target, mask_token_id=299, target_layer_ids=(0, 2), moe_experts=8, moe_top_k=9)


@pytest.mark.parametrize("changes, msg", [
    ({"draft_moe_experts": -1}, "'draft_moe_experts' must be an integer >= 2 .*0 or absent = the dense MLP"),
    ({"draft_moe_experts": 1}, "'draft_moe_experts' must be an integer >= 2 .*1 expert would be the dense MLP"),
    ({"draft_moe_experts": "8"}, "'draft_moe_experts' must be an integer >= 2 .*got '8'"),
    ({"draft_moe_experts": True}, "'draft_moe_experts' must be an integer >= 2 .*got True"),
    ({"draft_moe_experts": 8.0}, "'draft_moe_experts' must be an integer >= 2 .*got 8.0"),
    ({"draft_moe_top_k": 0}, "'draft_moe_top_k' must be an integer in 1..8 .*got 0"),
    ({"draft_moe_top_k": 9}, "'draft_moe_top_k' must be an integer in 1..8 .*at most draft_moe_experts = 8"),
    ({"draft_moe_top_k": None}, "'draft_moe_top_k' must be an integer in 1..8"),
    ({"draft_moe_intermediate_size": 0}, "'draft_moe_intermediate_size' must be an integer >= 1 .*got 0"),
    ({"draft_moe_intermediate_size": 2.5}, "'draft_moe_intermediate_size' must be an integer >= 1 .*got 2.5"),
])
def test_bad_moe_values_are_refused_by_name(changes, msg):
    with pytest.raises(DraftConfigError, match=msg):
        DSparkConfig.from_dict(dict(QWEN_MOE, **changes))


@pytest.mark.parametrize("missing", ["draft_moe_top_k", "draft_moe_intermediate_size"])
def test_moe_without_top_k_or_width_is_refused(missing):
    cfg = dict(QWEN_MOE)
    del cfg[missing]
    with pytest.raises(DraftConfigError, match=f"draft_moe_experts 8 needs '{missing}'.*does not guess"):
        DSparkConfig.from_dict(cfg)


@pytest.mark.parametrize("experts", [None, 0])
def test_moe_details_without_experts_are_refused(experts):
    cfg = dict(DEEPSPEC_CONFIG, draft_moe_top_k=2)
    if experts is not None:
        cfg["draft_moe_experts"] = experts
    with pytest.raises(DraftConfigError, match="'draft_moe_top_k' = 2 is given but draft_moe_experts is .*set "
                                               "draft_moe_experts to the number of experts"):
        DSparkConfig.from_dict(cfg)


@pytest.mark.parametrize("field, value", [("draft_moe_capacity_factor", 1.25), ("num_experts", 8),
                                          ("num_experts_per_tok", 2)])
def test_unknown_fields_are_still_refused(field, value):
    with pytest.raises(DraftConfigError, match=f"config field '{field}' = {value!r} is not implemented"):
        DSparkConfig.from_dict(dict(QWEN_MOE, **{field: value}))


# --- routing ----------------------------------------------------------------------------------------------------

@torch.no_grad()
def reference_moe(moe: DraftMoE, x: torch.Tensor, hidden_act: str = "silu") -> torch.Tensor:
    """Mixtral routing token by token in float64: the k most probable experts, weights renormalised."""
    from transformers.activations import ACT2FN

    act = ACT2FN[hidden_act]
    flat = x.reshape(-1, x.shape[-1]).double()
    out = torch.zeros_like(flat)
    wg = moe.gate.weight.double()
    for t in range(flat.shape[0]):
        p = torch.softmax(wg @ flat[t], dim=0).numpy()
        top = np.argsort(-p, kind="stable")[:moe.top_k]
        for j in top:
            e = moe.experts[int(j)]
            g, u = e.gate_proj.weight.double() @ flat[t], e.up_proj.weight.double() @ flat[t]
            out[t] += float(p[j] / p[top].sum()) * (e.down_proj.weight.double() @ (act(g) * u))
    return out.reshape(x.shape).to(x.dtype)


class _LoopMoE(torch.nn.Module):
    def __init__(self, moe, hidden_act):
        super().__init__()
        self.moe, self.hidden_act = moe, hidden_act

    def forward(self, x):
        return reference_moe(self.moe, x, self.hidden_act)


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_routing_equals_a_per_token_reference(top_k):
    m = _moe_model(dict(QWEN_MOE, draft_moe_top_k=top_k))
    moe = m.layers[0].mlp
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = moe(x)
        probs, w, top_i = moe.routing(x)
    np.testing.assert_allclose(got.numpy(), reference_moe(moe, x).numpy(), atol=1e-5, rtol=1e-5)
    # the weights: k non-zeros per token, the renormalised top-k probabilities, summing to 1
    assert probs.dtype == w.dtype == torch.float32 and top_i.shape == (2, 5, top_k)
    assert ((w > 0).sum(-1) == top_k).all()
    np.testing.assert_allclose(w.sum(-1).numpy(), 1.0, atol=1e-6)
    kth = probs.topk(top_k, dim=-1).values[..., -1:]
    assert torch.equal(w > 0, probs >= kth)
    np.testing.assert_allclose(w.numpy(), (probs * (probs >= kth) / (probs * (probs >= kth)).sum(-1, keepdim=True))
                               .numpy(), atol=1e-7)
    if top_k < 8:  # the sharpened router sends different tokens to different experts
        assert len({tuple(sorted(r)) for r in top_i.reshape(-1, top_k).tolist()}) > 1
    assert moe.last_router_probs is not None and torch.equal(moe.last_topk, top_i)


@pytest.mark.parametrize("name, cfg", [("qwen3", QWEN_MOE), ("gemma4", dict(GEMMA, **MOE))])
def test_drafter_block_uses_the_moe(name, cfg):
    """The whole drafter (context K/V, block, norms, LM head) with every layer's MoE replaced by the reference
    loop gives the same hidden states and logits (Qwen3 and Gemma-4 layers, their own activations)."""
    m = _moe_model(cfg)
    ref = copy.deepcopy(m)
    for layer in ref.layers:
        layer.mlp = _LoopMoE(layer.mlp, cfg.get("hidden_act") or cfg["hidden_activation"])
    feats, ctx_pos, ids, bpos = block_inputs(cfg)
    h, u = ours(m, feats, ctx_pos, ids, bpos)
    rh, ru = ours(ref, feats, ctx_pos, ids, bpos)
    np.testing.assert_allclose(h.numpy(), rh.numpy(), atol=2e-5)
    np.testing.assert_allclose(u.numpy(), ru.numpy(), atol=2e-5)
    dense = _random_model(GEMMA if name == "gemma4" else DEEPSPEC_CONFIG)
    assert not torch.allclose(ours(dense, feats, ctx_pos, ids, bpos)[0], h)


# --- load-balancing loss ----------------------------------------------------------------------------------------

ROUTER_PROBS = [[0.5, 0.3, 0.15, 0.05],  # top-2 {0, 1}
                [0.1, 0.6, 0.2, 0.1],  # {1, 2}
                [0.2, 0.1, 0.4, 0.3]]  # {2, 3}


def _known_router_model():
    """4 experts, top-2, and router logits log(ROUTER_PROBS[t]) for the unit input e_t (so P = ROUTER_PROBS)."""
    m = _moe_model(dict(QWEN_MOE, draft_moe_experts=4))
    with torch.no_grad():
        for layer in m.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:, :3] = torch.log(torch.tensor(ROUTER_PROBS)).T
    return m, torch.eye(32)[:3][None]  # x [1, 3, 32]


def test_aux_loss_equals_the_switch_formula_on_known_router_probs():
    m, x = _known_router_model()
    moe = m.layers[0].mlp
    with torch.no_grad():
        moe(x)
    np.testing.assert_allclose(moe.last_router_probs[0].numpy(), ROUTER_PROBS, atol=1e-6)
    # E·Σ f_i·P_i: P = column means, f = (1, 2, 2, 1) / (3 tokens · 2 slots)
    p_mean = np.mean(ROUTER_PROBS, axis=0)
    f = np.array([1, 2, 2, 1]) / 6
    assert float(moe.aux_loss()) == pytest.approx(4 * float(f @ p_mean), abs=1e-6)
    assert float(moe.aux_loss()) == pytest.approx(19 / 18, abs=1e-6)  # 4·(0.8 + 2·1.0 + 2·0.75 + 0.45) / 18
    # a token mask leaves the third token out: P = mean of rows 0-1, f = (1, 2, 1, 0) / 4
    mask = torch.tensor([[True, True, False]])
    p2, f2 = np.mean(ROUTER_PROBS[:2], axis=0), np.array([1, 2, 1, 0]) / 4
    assert float(moe.aux_loss(mask)) == pytest.approx(4 * float(f2 @ p2), abs=1e-6)
    assert float(moe.aux_loss(mask)) == pytest.approx(1.375, abs=1e-6)
    assert float(moe.aux_loss(mask.reshape(1, 3, 1))) == pytest.approx(1.375, abs=1e-6)  # [b, A, γ] layout


def test_model_aux_loss_averages_layers_and_trains_the_router():
    m, x = _known_router_model()
    with torch.no_grad():
        m.layers[1].mlp.gate.weight.zero_()  # layer 1: a uniform router scores exactly 1 (for any k)
    feats, ctx_pos, _, bpos = block_inputs(QWEN_MOE, n_ctx=3)
    kv = m.context_kv(feats, ctx_pos)
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    m.block_hidden(torch.tensor([[5, 6, 7]]), bpos[:, :3], kv, mask)
    l0, l1 = m.layers[0].mlp.aux_loss().detach(), m.layers[1].mlp.aux_loss().detach()
    assert float(l1) == pytest.approx(1.0, abs=1e-6)
    loss = m.moe_aux_loss()
    assert loss.shape == () and loss.dtype == torch.float32
    assert float(loss.detach()) == pytest.approx((float(l0) + float(l1)) / 2, abs=1e-7)
    m.zero_grad()
    (0.01 * loss).backward()
    assert m.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # through P (f is a count)
    # layer 0's router reads the stream before its experts (and layer 1's router is 0 here): no expert gradient
    g = m.layers[0].mlp.experts[0].up_proj.weight.grad
    assert g is None or float(g.abs().sum()) == 0.0
    # dense drafters: a zero tensor; a MoE before any forward: refused
    dense = DSparkDraftModel(DSparkConfig.from_dict(DEEPSPEC_CONFIG))
    assert dense.moe_aux_loss().shape == () and float(dense.moe_aux_loss()) == 0.0
    with pytest.raises(RuntimeError, match="no forward"):
        DSparkDraftModel(DSparkConfig.from_dict(QWEN_MOE)).moe_aux_loss()


def test_router_gets_gradient_from_the_task_loss_through_the_topk_weights():
    m = _moe_model()
    moe = m.layers[0].mlp
    moe(torch.randn(1, 4, 32)).pow(2).sum().backward()
    assert moe.gate.weight.grad.abs().sum() > 0
    used = set(moe.last_topk.flatten().tolist())
    for j, e in enumerate(moe.experts):  # an expert outside every token's top-k gets exactly zero gradient
        assert (e.up_proj.weight.grad.abs().sum() > 0) == (j in used), j


# --- checkpoints ------------------------------------------------------------------------------------------------

def _rewrite(folder, drop=(), config=None):
    from safetensors.torch import load_file, save_file

    t = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in t.items() if k not in drop}, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def test_checkpoint_round_trip_gives_identical_outputs(tmp_path):
    m = _moe_model()
    save_checkpoint(m, tmp_path, dtype=torch.float32, include_frozen=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert {k: cfg[k] for k in MOE_FIELDS} == MOE
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"layers.0.mlp.gate.weight", "layers.1.mlp.experts.7.down_proj.weight"} <= keys
    assert "layers.0.mlp.gate_proj.weight" not in keys
    back = load_checkpoint(tmp_path).eval()
    assert isinstance(back.layers[1].mlp, DraftMoE) and back.layers[1].mlp.top_k == 2
    a, b = m.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    args = block_inputs(QWEN_MOE)
    for x, y in zip(ours(m, *args), ours(back, *args)):
        assert torch.equal(x, y)
    # without the frozen copies (our default), from the target's embedding / LM head
    save_checkpoint(m, tmp_path / "lean", dtype=torch.float32)
    lean = load_checkpoint(tmp_path / "lean", target_embed=m.embed_tokens.weight, target_lm_head=m.lm_head.weight)
    assert torch.equal(ours(lean.eval(), *args)[1], ours(m, *args)[1])


def test_missing_expert_tensor_is_refused_by_name(tmp_path):
    save_checkpoint(_moe_model(), tmp_path, dtype=torch.float32, include_frozen=True)
    _rewrite(tmp_path, drop={"layers.1.mlp.experts.2.up_proj.weight"})
    with pytest.raises(DraftConfigError, match=re.escape("lacks tensor(s) ['layers.1.mlp.experts.2.up_proj.weight']")):
        load_checkpoint(tmp_path)


def test_mismatched_moe_checkpoints_are_refused_with_the_fix(tmp_path):
    save_checkpoint(_moe_model(), tmp_path / "moe", dtype=torch.float32, include_frozen=True)
    cfg = json.loads((tmp_path / "moe" / "config.json").read_text())
    # MoE tensors under a dense config
    _rewrite(tmp_path / "moe", config={k: v for k, v in cfg.items() if k not in MOE_FIELDS})
    with pytest.raises(DraftConfigError, match=r"'layers\.0\.mlp\.experts\.0\.down_proj\.weight'.*needs "
                                               "draft_moe_experts, draft_moe_top_k and draft_moe_intermediate_size"):
        load_checkpoint(tmp_path / "moe")
    # fewer experts in the config than in the checkpoint
    _rewrite(tmp_path / "moe", config=dict(cfg, draft_moe_experts=6))
    with pytest.raises(DraftConfigError, match=r"'layers\.0\.mlp\.experts\.6\.down_proj\.weight'.*gives "
                                               "draft_moe_experts 6"):
        load_checkpoint(tmp_path / "moe")
    # another expert width
    _rewrite(tmp_path / "moe", config=dict(cfg, draft_moe_intermediate_size=16))
    with pytest.raises(DraftConfigError, match=r"tensor 'layers\.0\.mlp\.experts\.0\.gate_proj\.weight' has shape "
                                               r"\(24, 32\), the config implies \(16, 32\)"):
        load_checkpoint(tmp_path / "moe")
    # a dense checkpoint under a MoE config
    save_checkpoint(_random_model(DEEPSPEC_CONFIG), tmp_path / "dense", dtype=torch.float32, include_frozen=True)
    dense_cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    _rewrite(tmp_path / "dense", config=dict(dense_cfg, **MOE))
    with pytest.raises(DraftConfigError, match=r"'layers\.0\.mlp\.down_proj\.weight'.*saved dense, so remove "
                                               "draft_moe_experts"):
        load_checkpoint(tmp_path / "dense")


# --- ONNX -------------------------------------------------------------------------------------------------------

def test_onnx_graph_matches_torch(tmp_path):
    import onnx

    from dspark_export.drafter.graph import export_draft_graph, validate_draft_graph

    m = _moe_model(dict(QWEN_MOE, num_hidden_layers=1, layer_types=["full_attention"]))
    export_draft_graph(m, tmp_path / "draft.onnx")
    rep = validate_draft_graph(m, tmp_path / "draft.onnx")
    assert rep["argmax_agreement"] == 1.0
    assert rep["max_abs_logit_diff"] < 1e-4 and rep["max_abs_hidden_diff"] < 1e-4, rep
    ops = {n.op_type for n in onnx.load(str(tmp_path / "draft.onnx")).graph.node}
    assert {"TopK", "Softmax"} <= ops  # the router is in the graph


# --- end to end -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_dspark(tiny_pair, tiny_feature_store, tmp_path_factory):
    """(engine_dir, checkpoint_dir, train_report): a tiny MoE drafter (8 experts, top-2) trained briefly on the
    tiny target's features (conftest's ``tiny_feature_store``, the dense tiny drafter's) and compiled with the
    target."""
    from dspark_export.engine_dir.build import Recipe, build_engine
    from dspark_export.drafter.graph import target_frozen_weights
    from dspark_export.drafter.train import TrainSettings, train

    tdir, _ = tiny_pair
    store = tiny_feature_store
    cfg = json.loads((tdir / "config.json").read_text())
    c = qwen2_draft_config(cfg, mask_token_id=cfg["vocab_size"] - 1, num_layers=1, intermediate_size=64,
                           block_size=4, target_layer_ids=(-1, 0), markov_rank=16, moe_experts=8, moe_top_k=2)
    torch.manual_seed(0)
    model = DSparkDraftModel(c)
    emb, head = target_frozen_weights(tdir)
    model.init_from_target(emb, head)
    root = tmp_path_factory.mktemp("dspark-moe")
    rep = train(store, model, head, root / "ckpt",
                TrainSettings(lr=3e-3, time_budget_s=600, max_steps=100, eval_every=1000, eval_seqs=6,
                              anchors_per_seq=16, warmup_steps=10),
                gamma=c.block_size, mask_token=c.mask_token_id, log=lambda *a: None)
    build_engine(Recipe(name="tiny-dspark-moe", target=str(tdir), draft=f"dspark:{root / 'ckpt'}"), root / "engine",
                 isolate=False, log=lambda *a: None)
    return root / "engine", root / "ckpt", rep


def test_moe_drafter_checkpoint_and_manifest(moe_dspark):
    engine_dir, ckpt, rep = moe_dspark
    cfg = json.loads((ckpt / "config.json").read_text())
    assert {k: cfg[k] for k in MOE_FIELDS} == {"draft_moe_experts": 8, "draft_moe_top_k": 2,
                                               "draft_moe_intermediate_size": 32}  # 64 // 2
    assert rep["heldout_acc_pos"][0] > 0.05, rep  # it learned (chance: 1/320; ~0.1 after 80 steps)
    m = json.loads((engine_dir / "manifest.json").read_text())
    assert m["speculation"]["draft_kind"] == "dspark"
    assert m["graphs"]["draft"]["validation"]["fp32"]["argmax_agreement"] == 1.0


def test_moe_drafter_greedy_equals_target_only(moe_dspark):
    from dspark_runtime.engine import Engine

    eng = Engine.load(moe_dspark[0], threads=1)
    accepted = 0
    for prompt in ("hello world", "def f(x):\n    return", "the the the the"):
        ref = eng.generate(prompt, max_new_tokens=40, draft="none")
        for gamma in (1, 4):
            got = eng.generate(prompt, max_new_tokens=40, draft="dspark", draft_length=gamma)
            assert got.token_ids == ref.token_ids, (prompt, gamma)
            assert got.stats.drafter == "dspark"
            accepted += got.stats.accepted
    assert accepted > 0  # its drafts were accepted, not only rejected
