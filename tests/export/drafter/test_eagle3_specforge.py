"""SpecForge / vLLM EAGLE-3 checkpoints (``LlamaForCausalLMEagle3``) through :mod:`dspark_export.drafter.eagle3`.

:func:`write_specforge_checkpoint` writes a tiny checkpoint as SpecForge's exporter saves one (its config.json
fields; tensors ``midlayer.*``, ``fc``, ``norm``, ``lm_head`` over the draft vocabulary, ``d2t`` int64 offsets and
``t2d`` bool mask; ``embed_tokens`` only when it was trained). Checked: the strict load, a forward written here from
SpecForge's ``LlamaDecoderLayer`` / ``LlamaForCausalLMEagle3`` and vLLM's ``compute_logits`` (target id = draft id +
d2t), the rotary tables of SpecForge's llama3 / linear RoPE, the refusals by name, and the ONNX graph against torch.
"""
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_export.drafter.config import DraftConfigError
from dspark_export.drafter.eagle3 import Eagle3Cache, load_eagle3_checkpoint

TINY = dict(hidden=32, heads=4, kv=2, head_dim=8, inter=48, vocab=97, target_hidden=24, theta=10000.0, eps=1e-6)


def specforge_config(vocab: int, draft_vocab: int, hidden: int, heads: int, kv: int, head_dim: int, inter: int,
                     theta: float, eps: float, target_hidden: int | None = None, layer_ids=None) -> dict:
    """config.json as SpecForge writes one (its configs/*-eagle3.json fields)."""
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 1, "eos_token_id": 2, "head_dim": head_dim, "hidden_act": "silu", "hidden_size": hidden,
           "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": 2048,
           "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": 1, "num_key_value_heads": kv,
           "pretraining_tp": 1, "rms_norm_eps": eps, "rope_scaling": None, "rope_theta": theta,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.0",
           "use_cache": True, "vocab_size": vocab, "draft_vocab_size": draft_vocab}
    if target_hidden is not None:
        cfg["target_hidden_size"] = target_hidden
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    return cfg


def vocab_tensors(ids: np.ndarray, vocab: int) -> dict:
    """SpecForge's d2t (target id − draft id, int64) and t2d (bool mask over the target vocabulary)."""
    ids = np.asarray(ids, np.int64)
    t2d = np.zeros(vocab, bool)
    t2d[ids] = True
    return {"d2t": torch.from_numpy(ids - np.arange(len(ids))), "t2d": torch.from_numpy(t2d)}


def write_specforge_checkpoint(folder: Path, cfg: dict, tensors: dict) -> Path:
    """``config.json`` + ``model.safetensors`` (``tensors`` in SpecForge's names) in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def random_specforge(folder: Path, n_layers: int = 3, draft_vocab: int = 40, with_embed: bool = True, seed: int = 0,
                     layer_ids=None, **change) -> tuple:
    """A random tiny SpecForge checkpoint (TINY sizes); returns (folder, draft vocabulary ids, tensors)."""
    t = dict(TINY, **change)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.2).to(torch.bfloat16)  # noqa: E731
    h, hd, th = t["hidden"], t["head_dim"], t["target_hidden"]
    ids = np.sort(np.random.default_rng(seed).choice(t["vocab"], draft_vocab, replace=False))
    tensors = {"fc.weight": rnd(h, n_layers * th), "norm.weight": 1 + rnd(h), "lm_head.weight": rnd(draft_vocab, h),
               "midlayer.self_attn.q_proj.weight": rnd(t["heads"] * hd, 2 * h),
               "midlayer.self_attn.k_proj.weight": rnd(t["kv"] * hd, 2 * h),
               "midlayer.self_attn.v_proj.weight": rnd(t["kv"] * hd, 2 * h),
               "midlayer.self_attn.o_proj.weight": rnd(h, t["heads"] * hd),
               "midlayer.mlp.gate_proj.weight": rnd(t["inter"], h), "midlayer.mlp.up_proj.weight": rnd(t["inter"], h),
               "midlayer.mlp.down_proj.weight": rnd(h, t["inter"]), **vocab_tensors(ids, t["vocab"])}
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        tensors[f"midlayer.{n}.weight"] = 1 + rnd(h)
    if with_embed:
        tensors["embed_tokens.weight"] = rnd(t["vocab"], h)
    cfg = specforge_config(t["vocab"], draft_vocab, h, t["heads"], t["kv"], hd, t["inter"], t["theta"], t["eps"],
                           target_hidden=th, layer_ids=layer_ids)
    return write_specforge_checkpoint(folder, cfg, tensors), ids, tensors


@pytest.fixture
def ckpt(tmp_path):
    return random_specforge(tmp_path / "sf", layer_ids=[1, 5, 8])


# ------------------------------------------------------------------ a forward written from SpecForge's code


def _rms(x, w, eps):
    x32 = x.float()
    return w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, pos, inv):
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def specforge_reference(t: dict, feats, next_ids, embed, c: dict, inv):
    """SpecForge's draft forward on one sequence (fp32): fc(features), ``midlayer`` over input_layernorm(embedding of
    the next token) ‖ hidden_norm(state) with causal attention, RoPE at positions 0..n-1, no q/k norms, then
    lm_head(norm(·)) over the draft vocabulary and vLLM's full-vocabulary logits (-inf outside target ids
    arange + d2t). Returns (states [n, d], target-vocabulary logits [n, V])."""
    f = {k: v.float() for k, v in t.items() if v.is_floating_point()}
    n, hd, eps = feats.shape[0], c["head_dim"], c["rms_norm_eps"]
    state = feats @ f["fc.weight"].T
    x = torch.cat([_rms(embed[next_ids], f["midlayer.input_layernorm.weight"], eps),
                   _rms(state, f["midlayer.hidden_norm.weight"], eps)], -1)
    pos = torch.arange(n)
    q = _rotate((x @ f["midlayer.self_attn.q_proj.weight"].T).view(n, -1, hd), pos, inv)
    k = _rotate((x @ f["midlayer.self_attn.k_proj.weight"].T).view(n, -1, hd), pos, inv)
    v = (x @ f["midlayer.self_attn.v_proj.weight"].T).view(n, -1, hd)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    s = s.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).reshape(n, -1)
    state = state + att @ f["midlayer.self_attn.o_proj.weight"].T
    hmid = _rms(state, f["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(hmid @ f["midlayer.mlp.gate_proj.weight"].T)
           * (hmid @ f["midlayer.mlp.up_proj.weight"].T)) @ f["midlayer.mlp.down_proj.weight"].T
    state = state + mlp
    draft = _rms(state, f["norm.weight"], eps) @ f["lm_head.weight"].T
    full = torch.full((n, c["vocab_size"]), float("-inf"))
    full[:, torch.arange(t["d2t"].shape[0]) + t["d2t"]] = draft
    return state, full


def test_strict_load_of_specforge_checkpoint(ckpt):
    folder, ids, _ = ckpt
    m = load_eagle3_checkpoint(folder)
    c = m.config
    assert (c.architecture, c.qk_norm, c.hidden_size, c.head_dim, c.vocab_size, c.draft_vocab_size) == (
        "LlamaForCausalLMEagle3", False, 32, 8, 97, 40)
    assert c.target_layer_ids == [1, 5, 8] and c.feature_size == 72 and m.fc.weight.shape == (32, 72)
    assert m.lm_head.weight.shape == (40, 32) and m.draft_vocab_ids.tolist() == ids.tolist()
    assert not hasattr(m.layers[0].self_attn, "q_norm") and c.ttt_length == 7  # SpecForge's default --ttt-length
    assert all(t.dtype == torch.float32 for t in m.state_dict().values())


def test_default_layers_follow_specforge(tmp_path):
    """No eagle_config: SpecForge's [1, L//2 - 1, L - 4] (outputs of those decoder layers) for a target of L."""
    folder, _, _ = random_specforge(tmp_path / "sf")
    assert load_eagle3_checkpoint(folder, target_num_layers=12).config.target_layer_ids == [1, 5, 8]
    with pytest.raises(DraftConfigError, match=r"no eagle_config.eagle_aux_hidden_state_layer_ids: SpecForge's "
                                               r"default layers \[1, L//2 - 1, L - 4\] need the target's layer count"):
        load_eagle3_checkpoint(folder)


def test_matches_specforge_forward(ckpt):
    """All positions of one sequence from an empty cache: draft states and target-vocabulary logits equal the
    reference forward written from SpecForge's layer (fp32)."""
    folder, ids, tensors = ckpt
    m = load_eagle3_checkpoint(folder).eval()
    c = json.loads((folder / "config.json").read_text())
    g = torch.Generator().manual_seed(3)
    n = 9
    feats = torch.randn(n, m.config.feature_size, generator=g)
    nxt = torch.randint(0, 97, (n,), generator=g)
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, 8, 2).float() / 8))
    ref_state, ref_logits = specforge_reference(tensors, feats, nxt, tensors["embed_tokens.weight"].float(), c, inv)
    with torch.no_grad():
        st = m(m.fuse(feats[None]), nxt[None], torch.arange(n)[None], Eagle3Cache())[0]
        draft = m.logits(st)
    full = torch.full((n, 97), float("-inf"))
    full[:, m.draft_vocab_ids] = draft
    assert (st - ref_state).abs().max() < 1e-5
    finite = torch.isfinite(ref_logits)
    assert torch.equal(finite, torch.isfinite(full)) and finite.sum() == n * 40
    assert (full[finite] - ref_logits[finite]).abs().max() < 1e-5
    assert torch.equal(full.argmax(-1), ref_logits.argmax(-1))


def test_embedding_from_the_target(tmp_path):
    """SpecForge leaves its frozen embedding out: the target's table fills it, and without one the load is refused."""
    folder, _, tensors = random_specforge(tmp_path / "sf", with_embed=False, layer_ids=[0, 2, 4])
    table = torch.randn(97, 32)
    m = load_eagle3_checkpoint(folder, target_embed=table)
    assert torch.equal(m.embed_tokens.weight, table)
    with pytest.raises(DraftConfigError, match=r"no embed_tokens.weight \(SpecForge leaves out its frozen copy of "
                                               r"the target's embedding\): pass the target's"):
        load_eagle3_checkpoint(folder)


@pytest.mark.parametrize("scaling, want", [
    ({"rope_type": "linear", "factor": 4.0}, lambda inv: inv / 4.0),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, None),
])
def test_rope_scaling_matches_specforge(tmp_path, scaling, want):
    """SpecForge's own llama3 table (its LlamaRotaryEmbedding) and linear one (positions / factor) equal ours."""
    folder, _, _ = random_specforge(tmp_path / "sf", layer_ids=[1, 5, 8], theta=500000.0)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "rope_scaling": scaling}))
    got = load_eagle3_checkpoint(folder).config.rope_inv_freq
    inv = 1.0 / (500000.0 ** (torch.arange(0, 8, 2).float() / 8))
    if want is None:  # SpecForge's llama3 rule, as written there
        lo, hi = 64 / scaling["low_freq_factor"], 64 / scaling["high_freq_factor"]
        wave = 2 * math.pi / inv
        smooth = (64 / wave - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
        ref = torch.where(wave < hi, inv, torch.where(wave > lo, inv / scaling["factor"],
                                                      (1 - smooth) * inv / scaling["factor"] + smooth * inv))
    else:
        ref = want(inv)
    assert torch.allclose(got, ref, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------- refusals


def _with_config(folder: Path, **change) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Eagle3Speculator"]}, r"speculators layout .* is not implemented"),
    ({"architectures": ["MysteryEagle3"]}, r"not DeepSpec's EAGLE-3 drafter \['Qwen3Eagle3Model'\] nor SpecForge / "
                                           r"vLLM's \['LlamaForCausalLMEagle3'\]"),
    ({"eagle_mystery_knob": 1}, r"config field 'eagle_mystery_knob' = 1 is not implemented by this loader's "
                                r"LlamaForCausalLMEagle3 layer"),
    ({"fc_norm": True}, r"fc_norm true is not implemented \(an RMSNorm of each fused target state before fc "
                        r"\(tensors fc_norm\.\*\)\); the layer implements fc_norm false"),
    ({"norm_output": False}, r"norm_output false is not implemented"),
    ({"norm_before_residual": True}, r"norm_before_residual true is not implemented"),
    ({"attention_bias": True}, r"attention_bias true is not implemented \(SpecForge's q/k/v/o projections have no "
                               r"bias"),
    ({"num_hidden_layers": 2}, r"num_hidden_layers 2 is not implemented: one draft layer"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
     r"rope_type 'yarn' is not implemented for the LlamaForCausalLMEagle3 layer"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8], "use_aux_hidden_state": False}},
     r"use_aux_hidden_state false .* is not implemented"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8], "mystery": 1}},
     r"eagle_config key\(s\) \['mystery'\] are not implemented"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 1, 8]}}, r"strictly increasing list of target layers"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 6, 9]}, r"'eagle_aux_hidden_state_layer_ids' = \[2, 6, 9\]: top-level "
                                                      r"layer ids are vLLM / speculators' convention"),
    ({"draft_vocab_size": 98}, r"draft_vocab_size 98 exceeds vocab_size 97"),
])
def test_refuses_config_fields_by_name(ckpt, change, message):
    with pytest.raises(DraftConfigError, match=message):
        load_eagle3_checkpoint(_with_config(ckpt[0], **change))


def test_refuses_a_final_layer_id(ckpt):
    with pytest.raises(DraftConfigError, match=r"layer ids \[1, 5, 8\] must lie below the target's final layer 8"):
        load_eagle3_checkpoint(ckpt[0], target_num_layers=9)


def _tensors(folder: Path, change: dict, drop=()):
    t = load_file(str(folder / "model.safetensors"))
    t.update(change)
    for n in drop:
        t.pop(n)
    save_file(t, str(folder / "model.safetensors"))
    return folder


def test_refuses_vocabulary_maps_by_name(tmp_path):
    src, ids, _ = random_specforge(tmp_path / "src", layer_ids=[1, 5, 8])

    def case(name, change, drop=()):
        d = tmp_path / name
        shutil.copytree(src, d)
        return _tensors(d, change, drop)

    with pytest.raises(DraftConfigError, match=r"d2t without t2d: SpecForge writes both"):
        load_eagle3_checkpoint(case("no-t2d", {}, ["t2d"]))
    with pytest.raises(DraftConfigError, match=r"t2d without d2t"):
        load_eagle3_checkpoint(case("no-d2t", {}, ["d2t"]))
    with pytest.raises(DraftConfigError, match=r"draft_vocab_size 40 < vocab_size 97 but the checkpoint has no "
                                               r"d2t/t2d map"):
        load_eagle3_checkpoint(case("none", {}, ["d2t", "t2d"]))
    extra = vocab_tensors(ids, 97)["t2d"].clone()
    extra[int(np.setdiff1d(np.arange(97), ids)[0])] = True
    with pytest.raises(DraftConfigError, match=r"t2d marks 41 target ids but is not exactly the 40 that d2t maps "
                                               r"to"):
        load_eagle3_checkpoint(case("t2d-extra", {"t2d": extra}))
    d2t = vocab_tensors(ids, 97)["d2t"].clone()
    d2t[-1] = 97  # beyond the vocabulary
    with pytest.raises(DraftConfigError, match=r"d2t maps draft ids to target ids outside 0..96 or not strictly "
                                               r"increasing"):
        load_eagle3_checkpoint(case("d2t-out", {"d2t": d2t}))
    with pytest.raises(DraftConfigError, match=r"t2d must be bool \[97\]"):
        load_eagle3_checkpoint(case("t2d-int", {"t2d": vocab_tensors(ids, 97)["t2d"].to(torch.int64)}))


def test_refuses_tensors_it_does_not_name(tmp_path):
    src, _, _ = random_specforge(tmp_path / "src", layer_ids=[1, 5, 8])
    d = tmp_path / "qnorm"
    shutil.copytree(src, d)
    _tensors(d, {"midlayer.self_attn.q_norm.weight": torch.ones(8)})
    with pytest.raises(DraftConfigError, match=r"\['layers\.0\.self_attn\.q_norm\.weight'\] are not part of"):
        load_eagle3_checkpoint(d)
    d = tmp_path / "twice"
    shutil.copytree(src, d)
    _tensors(d, {"layers.0.mlp.up_proj.weight": torch.zeros(48, 32)})
    with pytest.raises(DraftConfigError, match=r"'layers\.0\.mlp\.up_proj\.weight' is given both as midlayer"):
        load_eagle3_checkpoint(d)
    d = tmp_path / "fc"
    shutil.copytree(src, d)
    _tensors(d, {"fc.weight": torch.zeros(32, 96)})  # three layers of the draft's width, not target_hidden_size 24
    with pytest.raises(DraftConfigError, match=r"'fc.weight' has shape \(32, 96\), the config implies \(32, 72\)"):
        load_eagle3_checkpoint(d)


def test_deepspec_layout_still_refuses_a_vocabulary_map(tmp_path):
    """d2t/t2d in a Qwen3Eagle3Model checkpoint: refused, naming the layout that loads them."""
    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "data" / "deepspec_parity" / "eagle3"
    d = tmp_path / "ds"
    shutil.copytree(fixture, d)
    _tensors(d, vocab_tensors(np.arange(10, 50), 97))
    with pytest.raises(DraftConfigError, match=r"in a Qwen3Eagle3Model checkpoint: .*the SpecForge / vLLM layout "
                                               r"\(architectures \['LlamaForCausalLMEagle3'\], draft_vocab_size\) "
                                               r"with d2t/t2d loads"):
        load_eagle3_checkpoint(d)


# ------------------------------------------------------------------------------------- the ONNX graph


def test_graph_matches_torch(ckpt, tmp_path):
    """The eagle3_draft graph of a SpecForge drafter: logits over the draft vocabulary [batch, 40], equal to torch
    over three chained calls (validate_eagle3_graph), and the draft vocabulary written beside it."""
    from dspark_export.drafter.eagle3_graph import DRAFT_VOCAB_FILE, export_eagle3

    folder, ids, _ = ckpt
    res = export_eagle3(folder, tmp_path / "out")
    spec = res["spec"]
    logits = next(t for t in spec["outputs"] if t["name"] == "logits")
    assert logits["shape"][-1] == 40 and spec["dims"]["vocab_size"] == 40
    v = res["validation"]["fp32"]
    assert v["argmax_agreement"] == 1.0 and v["max_abs_logit_diff"] < 1e-4
    assert res["draft_vocab"] == DRAFT_VOCAB_FILE
    saved = np.load(tmp_path / "out" / DRAFT_VOCAB_FILE, allow_pickle=False)
    assert saved.dtype == np.int64 and saved.tolist() == ids.tolist()
    assert res["config"]["architectures"] == ["LlamaForCausalLMEagle3"]


@pytest.mark.parametrize("target_rope,theta,scaling", [
    ({"rope_theta": 1e6}, 1e6, None),  # transformers 4's config.json
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, 1e6, None),  # transformers 5's
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, 5e5,
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
])
def test_specforge_config_for_takes_the_targets_rope(target_rope, theta, scaling):
    """A drafter made for a target rotates as the target does, whichever way its config.json writes RoPE (a
    transformers 5 config has no top-level rope_theta: it must not fall back to 10,000)."""
    from dspark_export.drafter.eagle3_specforge import specforge_config_for
    t = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 320, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, **target_rope}
    cfg = specforge_config_for(t, [0, 1], 96)
    assert cfg["rope_theta"] == theta
    assert cfg.get("rope_scaling") == scaling
