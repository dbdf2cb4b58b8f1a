"""The SpecForge / vLLM EAGLE-3 layout (``LlamaForCausalLMEagle3``) read onto the torch model of
:mod:`dspark_export.drafter.eagle3`: its ``config.json`` fields (:func:`specforge_fields`: used, accepted with the
reason, or refused by name) and its tensors (:func:`specforge_tensors`: renamed to our names, the vocabulary map
checked and turned into target ids); and written (:func:`specforge_config_for`, :func:`save_specforge_checkpoint`)
for drafters trained here with a reduced vocabulary.

Sources: SpecForge 0.2.0 ``specforge/modeling/draft/llama3_eagle.py`` (``LlamaForCausalLMEagle3``: ``midlayer.``
Llama layer without q/k norms or biases, ``fc`` over ``target_hidden_size`` per fused layer, ``lm_head`` of
``draft_vocab_size`` rows, buffers ``d2t`` int64 [V_d] and ``t2d`` bool [V]), ``specforge/data/preprocessing.py``
(``d2t[i]`` = target id − i of the i-th draft token, ids ascending; ``t2d[t]`` = t is a draft token),
``specforge/algorithms/model_providers.py`` (capture layers: ``eagle_config.eagle_aux_hidden_state_layer_ids``,
default ``[1, L//2 − 1, L − 4]``, each the output of that decoder layer: sglang captures the input of layer id + 1),
``specforge/export/to_sglang.py`` (``embed_tokens`` left out when frozen: the target's is used); vLLM
``vllm/model_executor/models/llama_eagle3.py`` (target id = draft id + d2t[draft id], logits -inf elsewhere).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dspark_export.drafter.checkpoint import write_weights
from dspark_export.drafter.config_fields import DraftConfigError, activation, bool_field, int_field, rope_parameters
from dspark_export.drafter.families import IGNORED_FIELDS, QWEN3

ARCHITECTURE = "LlamaForCausalLMEagle3"
DEFAULT_TTT_LENGTH = 7  # SpecForge's default --ttt-length: the draft steps per round it trains (the default γ)
USED_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size",
               "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling", "rope_parameters",
               "original_max_position_embeddings", "max_position_embeddings", "eagle_config")
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "rms_norm_eps")
# accepted only with the value SpecForge's layer implements (checked in specforge_fields): name -> (value, reason)
CONDITIONAL = {
    "attention_bias": (False, "SpecForge's q/k/v/o projections have no bias (vLLM would add one)"),
    "mlp_bias": (False, "SpecForge's Llama MLP has no bias"),
    "use_sliding_window": (False, "SpecForge's attention has no window"),
    "fc_norm": (False, "an RMSNorm of each fused target state before fc (tensors fc_norm.*)"),
    "norm_output": (True, "logits from the un-normed state"),
    "norm_before_residual": (False, "vLLM's option of taking the residual after hidden_norm; SpecForge's layer "
                                    "takes it before"),
}
IGNORED = dict(
    IGNORED_FIELDS,
    model_type="SpecForge and vLLM build the Llama EAGLE-3 layer from architectures, whatever model_type says",
    tie_word_embeddings="SpecForge's drafter never ties: its lm_head [draft_vocab_size, hidden] is a tensor of "
                        "the checkpoint, read as such",
    sliding_window="read only with use_sliding_window true, which is refused",
    max_window_layers="a Qwen2 sliding-window field the Llama layer never reads",
)
REFUSED = {
    "eagle_aux_hidden_state_layer_ids": "top-level layer ids are vLLM / speculators' convention (id = the input of "
                                        "decoder layer id), one off from SpecForge's eagle_config ids (the output "
                                        "of layer id); put the ids, as outputs of decoder layers, in "
                                        "eagle_config.eagle_aux_hidden_state_layer_ids",
}
REFUSED_ARCHITECTURES = {
    "Eagle3Speculator": "the speculators layout (transformer_layer_config / speculators_config, layer ids in vLLM's "
                        f"input-of-layer convention) is not implemented; SpecForge's {ARCHITECTURE} loads",
}
NOT_IN_DEEPSPEC = ("DeepSpec's layout has a full-vocabulary head. Not supported yet in that layout; the SpecForge / "
                   f"vLLM layout (architectures [{ARCHITECTURE!r}], draft_vocab_size) with d2t/t2d loads")
EAGLE_CONFIG_KEYS = ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state")
ROPE_TYPES = ("default", "linear", "llama3")  # SpecForge's own rotary tables equal transformers' for these


def _fail(source: str, msg: str) -> DraftConfigError:
    return DraftConfigError(f"{source}: {msg}")


def _layer_ids(d: dict, source: str, target_num_layers: int | None) -> list:
    """The fused target layers (ours: id i = output of decoder layer i, -1 = embeddings), from
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` or SpecForge's default for a target of ``target_num_layers``."""
    ec = d.get("eagle_config") or {}
    if not isinstance(ec, dict):
        raise _fail(source, f"eagle_config must be an object, got {ec!r}")
    extra = [k for k in ec if k not in EAGLE_CONFIG_KEYS]
    if extra:
        raise _fail(source, f"eagle_config key(s) {extra} are not implemented (it reads {list(EAGLE_CONFIG_KEYS)})")
    if ec.get("use_aux_hidden_state", True) is not True:
        raise _fail(source, "eagle_config.use_aux_hidden_state false (drafting from the target's last state, "
                            "EAGLE-1 style, without fc) is not implemented")
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if target_num_layers is None:
            raise _fail(source, "no eagle_config.eagle_aux_hidden_state_layer_ids: SpecForge's default layers "
                                "[1, L//2 - 1, L - 4] need the target's layer count L (add-draft passes the engine "
                                "target's); pin the ids in the config or load with target_num_layers")
        n = int(target_num_layers)
        ids = [1, n // 2 - 1, n - 4]
    if (not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
            or any(b <= a for a, b in zip(ids, ids[1:])) or min(ids) < -1):
        raise _fail(source, f"eagle_aux_hidden_state_layer_ids must be a non-empty strictly increasing list of "
                            f"target layers >= -1 (the output of decoder layer i; -1 = the embeddings), in the order "
                            f"their states are concatenated, got {ids!r}")
    if target_num_layers is not None and max(ids) >= target_num_layers - 1:
        raise _fail(source, f"layer ids {ids} must lie below the target's final layer {target_num_layers - 1}: "
                            "sglang and vLLM capture a layer's input, never the final layer's output")
    return list(ids)


def specforge_fields(d: dict, source: str, target_num_layers: int | None = None) -> dict:
    """The :class:`~dspark_export.drafter.eagle3.Eagle3Config` keyword arguments of a SpecForge / vLLM EAGLE-3
    ``config.json`` dict ``d`` (architectures ["LlamaForCausalLMEagle3"]): one Llama layer without q/k norms, a draft
    vocabulary of ``draft_vocab_size`` (default ``vocab_size``, as vLLM), ``target_hidden_size`` per fused layer.
    ``target_num_layers``: the target's decoder layer count, for SpecForge's default layers and the final-layer check.

    Raises:
        DraftConfigError: a missing or malformed field, or a field, value or option not implemented (named).
    """
    known = set(USED_FIELDS) | set(CONDITIONAL) | set(IGNORED)
    for k, why in REFUSED.items():
        if k in d:
            raise _fail(source, f"config field {k!r} = {d[k]!r}: {why}")
    unknown = [k for k in d if k not in known]
    if unknown:
        raise _fail(source, f"config field {unknown[0]!r} = {d[unknown[0]]!r}"
                            f"{f' (and {unknown[1:]})' if len(unknown) > 1 else ''} is not implemented by this "
                            f"loader's {ARCHITECTURE} layer; loading would ignore it and draft with another function")
    missing = [k for k in REQUIRED_FIELDS if k not in d]
    if missing:
        raise _fail(source, f"missing field(s) {missing} of a SpecForge EAGLE-3 draft config")
    _int = lambda name, default=None: int_field(d, source, name, 1, default)  # noqa: E731
    for k, (value, why) in CONDITIONAL.items():
        if bool_field(d, source, k, value) != value:
            raise _fail(source, f"{k} {str(not value).lower()} is not implemented ({why}); the layer implements "
                                f"{k} {str(value).lower()}")
    if _int("num_hidden_layers") != 1:
        raise _fail(source, f"num_hidden_layers {d['num_hidden_layers']} is not implemented: one draft layer "
                            "(SpecForge's midlayer) only")
    heads, kv = _int("num_attention_heads"), _int("num_key_value_heads")
    hidden, vocab = _int("hidden_size"), _int("vocab_size")
    head_dim = _int("head_dim") if d.get("head_dim") is not None else hidden // heads
    if heads % kv or head_dim % 2:
        raise _fail(source, f"{heads} heads over {kv} KV heads of size {head_dim}: heads must be a multiple of the "
                            "KV heads and the head size even (RoPE)")
    draft_vocab = _int("draft_vocab_size") if d.get("draft_vocab_size") is not None else vocab
    if draft_vocab > vocab:
        raise _fail(source, f"draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
    rope = rope_parameters(d, QWEN3, source)
    if rope["rope_type"] not in ROPE_TYPES:
        raise _fail(source, f"rope_type {rope['rope_type']!r} is not implemented for the {ARCHITECTURE} layer: "
                            f"SpecForge's own rotary tables compute transformers' frequencies for {list(ROPE_TYPES)} "
                            "only (its yarn and mrope are its own)")
    mpe, th, eps = d.get("max_position_embeddings"), d.get("target_hidden_size"), d["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise _fail(source, f"rms_norm_eps must be a positive number, got {eps!r}")
    act = activation(d.get("hidden_act", "silu"), "hidden_act", source)
    return dict(hidden_size=hidden, intermediate_size=_int("intermediate_size"), num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=head_dim, vocab_size=vocab, rms_norm_eps=float(eps),
                target_layer_ids=_layer_ids(d, source, target_num_layers), ttt_length=DEFAULT_TTT_LENGTH,
                num_target_layers=target_num_layers, hidden_act=act, rope_parameters=rope,
                max_position_embeddings=None if mpe is None else _int("max_position_embeddings"), qk_norm=False,
                draft_vocab_size=draft_vocab, target_hidden_size=None if th is None else _int("target_hidden_size"),
                architecture=ARCHITECTURE)


def checkpoint_holds_embedding(path: Path) -> bool:
    """Whether the checkpoint folder's safetensors hold ``embed_tokens.weight`` (names read, no tensor)."""
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            if "embed_tokens.weight" in s.keys():
                return True
    return False


def _vocab_map(tensors: dict, c, path) -> torch.Tensor | None:
    """``d2t`` / ``t2d`` (popped from ``tensors``) as the target ids of the lm_head rows, int64 [V_d]; None when the
    draft vocabulary is the target's in order. Raises DraftConfigError when one comes without the other, a shape or
    dtype is off, or t2d is not exactly the set d2t maps to."""
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    vd, v = c.draft_vocab_size, c.vocab_size
    if d2t is None and t2d is None:
        if vd != v:
            raise DraftConfigError(f"{path}: draft_vocab_size {vd} < vocab_size {v} but the checkpoint has no d2t/t2d "
                                   "map from draft to target ids; add SpecForge's d2t and t2d tensors")
        return None
    if d2t is None or t2d is None:
        raise DraftConfigError(f"{path}: {'d2t' if t2d is None else 't2d'} without "
                               f"{'t2d' if t2d is None else 'd2t'}: SpecForge writes both (d2t int64 [draft_vocab_size]"
                               " offsets, t2d bool [vocab_size]); the map is refused rather than half-checked")
    if d2t.dtype not in (torch.int64, torch.int32) or tuple(d2t.shape) != (vd,):
        raise DraftConfigError(f"{path}: d2t must be integer [{vd}] (draft_vocab_size), got {d2t.dtype} "
                               f"{tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (v,):
        raise DraftConfigError(f"{path}: t2d must be bool [{v}] (vocab_size), got {t2d.dtype} {tuple(t2d.shape)}")
    ids = torch.arange(vd, dtype=torch.int64) + d2t.to(torch.int64)  # vLLM: target id = draft id + d2t[draft id]
    if int(ids.min()) < 0 or int(ids.max()) >= v or bool((ids[1:] <= ids[:-1]).any()):
        raise DraftConfigError(f"{path}: d2t maps draft ids to target ids outside 0..{v - 1} or not strictly "
                               "increasing (SpecForge sorts its draft tokens); the map is inconsistent")
    if not torch.equal(torch.nonzero(t2d).flatten(), ids):
        raise DraftConfigError(f"{path}: t2d marks {int(t2d.sum())} target ids but is not exactly the {vd} that d2t "
                               "maps to; the d2t/t2d map is inconsistent")
    return None if vd == v else ids


def specforge_tensors(tensors: dict, c, path, target_embed=None) -> tuple:
    """A SpecForge checkpoint's tensors in our names: ``midlayer.`` -> ``layers.0.``, the vocabulary map taken out
    (:func:`_vocab_map`), ``embed_tokens.weight`` = ``target_embed`` [V, d] where the checkpoint leaves it out.
    Returns (tensors, draft_vocab_ids int64 [V_d] or None, embedding from the target?).

    Raises:
        DraftConfigError: a name given twice (``midlayer.`` and ``layers.0.``), an inconsistent vocabulary map, or
            no embedding in the checkpoint and none given.
    """
    out = {}
    for n, t in tensors.items():
        name = "layers.0." + n[len("midlayer."):] if n.startswith("midlayer.") else n
        if name in out:
            raise DraftConfigError(f"{path}: tensor {name!r} is given both as midlayer.* and layers.0.*")
        out[name] = t
    ids = _vocab_map(out, c, path)
    from_target = "embed_tokens.weight" not in out
    if from_target:
        if target_embed is None:
            raise DraftConfigError(f"{path}: no embed_tokens.weight (SpecForge leaves out its frozen copy of the "
                                   "target's embedding): pass the target's model.embed_tokens.weight as target_embed "
                                   "(add-draft reads the target graph's table)")
        out["embed_tokens.weight"] = torch.as_tensor(target_embed)
    return out, ids, from_target


def specforge_config_for(target_config: dict, target_layer_ids, draft_vocab_size: int,
                         intermediate_size: int | None = None) -> dict:
    """A SpecForge-layout ``config.json`` dict for a drafter of the target ``target_config`` (its ``config.json``):
    one Llama layer of the target's width and heads (``intermediate_size`` defaults to the target's), fusing
    ``target_layer_ids`` (our convention = SpecForge's ``eagle_config`` ids), an LM head over ``draft_vocab_size``
    tokens. Its rotary table is the target's (``rope_theta``, and ``rope_scaling`` where the target has one, read from
    ``rope_theta`` / ``rope_scaling`` or transformers 5's ``rope_parameters``). Raises DraftConfigError for a RoPE the
    drafter layer does not implement."""
    t = target_config
    # the target's RoPE as transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters) writes it
    rope = rope_parameters(t, QWEN3, "target config")
    cfg = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": t["hidden_size"],
           "intermediate_size": intermediate_size or t["intermediate_size"], "num_hidden_layers": 1,
           "num_attention_heads": t["num_attention_heads"],
           "num_key_value_heads": t.get("num_key_value_heads", t["num_attention_heads"]),
           "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
           "vocab_size": t["vocab_size"], "draft_vocab_size": int(draft_vocab_size),
           "target_hidden_size": t["hidden_size"], "rms_norm_eps": t["rms_norm_eps"],
           "hidden_act": t.get("hidden_act", "silu"), "rope_theta": float(rope["rope_theta"]),
           "max_position_embeddings": t.get("max_position_embeddings"), "tie_word_embeddings": False,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(x) for x in target_layer_ids],
                            "use_aux_hidden_state": True}}
    if rope["rope_type"] != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


def save_specforge_checkpoint(model, out_dir: Path, *, dtype=torch.float32, shard_bytes: int | None = None) -> Path:
    """Write a SpecForge-layout drafter (an :class:`~dspark_export.drafter.eagle3.Eagle3DraftModel` whose config is
    SpecForge's) as SpecForge's exporter does: ``midlayer.*``, ``lm_head`` over the draft vocabulary, ``d2t`` (target
    id − draft id) and ``t2d`` (the draft tokens), no ``embed_tokens`` (the target's frozen table is used), floating
    tensors as ``dtype`` (``shard_bytes``: in shards, :func:`~dspark_export.drafter.checkpoint.write_weights`).
    Returns the folder. Raises DraftConfigError for another layout or without a map."""
    c = model.config
    if c.architecture != ARCHITECTURE or model.draft_vocab_ids is None:
        raise DraftConfigError(f"save_specforge_checkpoint writes the {ARCHITECTURE} layout with a draft vocabulary, "
                               f"not {c.architecture} (draft vocabulary {model.draft_vocab_ids is not None})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t.detach().cpu().to(dtype)
               for n, t in model.state_dict().items() if n != "embed_tokens.weight"}
    ids = model.draft_vocab_ids.detach().cpu().to(torch.int64)
    tensors["d2t"] = ids - torch.arange(len(ids), dtype=torch.int64)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    write_weights({k: v.contiguous() for k, v in tensors.items()}, out_dir, shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(c.source, indent=2) + "\n")
    return out_dir
