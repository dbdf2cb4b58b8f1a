"""Config-field readers shared by the DSpark (:mod:`dspark_export.drafter.config`) and EAGLE-3
(:mod:`dspark_export.drafter.eagle3`) draft configs: the error they raise (:class:`DraftConfigError`), typed fields,
the config.json file itself, the RoPE parameters and their rotary table (transformers' own rotary classes, so every
supported rope_type matches transformers exactly), and the activation.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_runtime.errors import DSparkError

from dspark_export.drafter.families import GEMMA4, ROPE_KEYS, ROPE_REFUSED, ROPE_TYPES


class DraftConfigError(DSparkError):
    """A DSpark draft config.json or checkpoint is missing a field or tensor, has a malformed one, or holds a
    value or tensor this loader does not implement (the message names it and what would support it)."""


def int_field(d: dict, source: str, name: str, lo: int | None = None, default=None) -> int:
    """Config field ``name`` of ``d`` (``default`` when absent) as an integer (>= ``lo``). Raises DraftConfigError
    naming the field and ``source`` otherwise (a bool is not an integer here)."""
    v = d.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise DraftConfigError(f"{source}: field {name!r} must be an integer"
                               f"{f' >= {lo}' if lo is not None else ''}, got {v!r}")
    return v


def bool_field(d: dict, source: str, name: str, default) -> bool:
    """Config field ``name`` of ``d`` (``default`` when absent) as true/false. Raises DraftConfigError naming the
    field and ``source`` otherwise."""
    v = d.get(name, default)
    if not isinstance(v, bool):
        raise DraftConfigError(f"{source}: field {name!r} must be true or false, got {v!r}")
    return v


def read_config_json(path: Path, what: str) -> tuple:
    """(the JSON object, its file name) of a draft ``config.json`` (``path``: a folder or the file itself); ``what``
    names the drafter in errors ("DSpark"). Raises DraftConfigError for a missing file or bad JSON."""
    path = Path(path)
    f = path / "config.json" if path.is_dir() else path
    if not f.is_file():
        raise DraftConfigError(f"no {what} draft config at {f}: pass a checkpoint folder holding config.json and "
                               "model.safetensors")
    try:
        return json.loads(f.read_text()), str(f)
    except json.JSONDecodeError as e:
        raise DraftConfigError(f"{f}: not valid JSON ({e})") from None


def rope_parameters(d: dict, fam: str, source: str) -> dict:
    """The RoPE parameters of the draft layers (a flat dict with rope_type and rope_theta)."""
    if fam == GEMMA4:
        rp = d.get("rope_parameters")
        if not isinstance(rp, dict) or not isinstance(rp.get("full_attention"), dict):
            raise DraftConfigError(f"{source}: a Gemma-4 DSpark config needs rope_parameters['full_attention'] (the "
                                   f"RoPE of full-attention layers, which DeepSpec's drafter uses), got {rp!r}")
        p = dict(rp["full_attention"])
        where = "rope_parameters['full_attention']"
    else:
        rp, rs = d.get("rope_parameters"), d.get("rope_scaling")
        for name, v in (("rope_parameters", rp), ("rope_scaling", rs)):
            if v is not None and not isinstance(v, dict):
                raise DraftConfigError(f"{source}: {name} must be an object or null, got {v!r}")
        if rp and rs and {k: v for k, v in rp.items() if k != "rope_theta"} != {
                k: v for k, v in rs.items() if k != "rope_theta"}:
            raise DraftConfigError(f"{source}: rope_parameters {rp!r} and rope_scaling {rs!r} disagree; give one")
        p = dict(rp or rs or {})
        where = "rope_parameters" if rp else "rope_scaling" if rs else "config"
        theta = d.get("rope_theta")
        if theta is not None:
            if "rope_theta" in p and float(p["rope_theta"]) != float(theta):
                raise DraftConfigError(f"{source}: rope_theta {theta!r} and {where}['rope_theta'] "
                                       f"{p['rope_theta']!r} disagree")
            p["rope_theta"] = theta
        top = d.get("original_max_position_embeddings")
        if top is not None:
            if "original_max_position_embeddings" in p and p["original_max_position_embeddings"] != top:
                raise DraftConfigError(f"{source}: original_max_position_embeddings {top!r} and {where}"
                                       f"['original_max_position_embeddings'] {p['original_max_position_embeddings']!r}"
                                       " disagree")
            if p.get("rope_type", p.get("type")) in ("yarn", "llama3"):
                p["original_max_position_embeddings"] = top
    if "type" in p:  # the old name of rope_type
        legacy = p.pop("type")
        if p.setdefault("rope_type", legacy) != legacy:
            raise DraftConfigError(f"{source}: {where} has type {legacy!r} and rope_type {p['rope_type']!r}")
    kind = p.setdefault("rope_type", "default")
    if kind in ROPE_REFUSED:
        raise DraftConfigError(f"{source}: {where} rope_type {kind!r} is refused: {ROPE_REFUSED[kind]}. Supported: "
                               f"{list(ROPE_TYPES[fam])} for the {fam} layer")
    if kind not in ROPE_TYPES[fam]:
        raise DraftConfigError(f"{source}: {where} rope_type {kind!r} is not implemented for the {fam} layer "
                               f"(supported: {list(ROPE_TYPES[fam])})")
    if "rope_theta" not in p:
        raise DraftConfigError(f"{source}: no rope_theta (top level or in {where}); the loader does not guess the "
                               "RoPE base — give the target's value")
    extra = [k for k in p if k not in ("rope_type", "rope_theta", "partial_rotary_factor") + ROPE_KEYS[kind]]
    if extra:
        raise DraftConfigError(f"{source}: {where} key(s) {extra} are not read by the {kind!r} RoPE "
                               f"(it reads {['rope_theta', *ROPE_KEYS[kind]]}); refusing rather than ignoring them")
    prf = p.get("partial_rotary_factor", 1.0)
    if kind != "proportional" and prf != 1.0:
        raise DraftConfigError(f"{source}: {where} partial_rotary_factor {prf!r} is not implemented: DeepSpec's "
                               f"{fam} layer rotates whole heads (only Gemma-4's 'proportional' RoPE leaves "
                               "a part of each head unrotated)")
    return p


def rotary_table(c):
    """(inv_freq float32 [head_dim/2], attention scaling) of the draft layers' RoPE (``c``: a DSparkConfig or
    Eagle3Config: its layer, rope_parameters, head sizes and max_position_embeddings), from transformers' own
    rotary embedding of the layer family (``Qwen3RotaryEmbedding`` / ``Gemma4TextRotaryEmbedding``), so
    every supported rope_type matches transformers exactly.

    Raises:
        DraftConfigError: transformers rejects the RoPE parameters.
    """
    import logging

    log = logging.getLogger("transformers.modeling_rope_utils")
    level = log.level
    log.setLevel(logging.ERROR)  # its key warnings repeat what from_dict checked
    p = json.loads(json.dumps(c.rope_parameters))
    mpe = {"max_position_embeddings": c.max_position_embeddings} if c.max_position_embeddings else {}
    try:
        with torch.device("cpu"):
            if c.layer == GEMMA4:
                from transformers import Gemma4TextConfig
                from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

                tc = Gemma4TextConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                                      global_head_dim=c.head_dim, num_global_key_value_heads=c.num_key_value_heads,
                                      attention_k_eq_v=c.attention_k_eq_v, num_hidden_layers=1,
                                      layer_types=["full_attention"], hidden_size_per_layer_input=0,
                                      rope_parameters={"full_attention": p}, **mpe)
                rot = Gemma4TextRotaryEmbedding(tc)
                inv, scale = rot.full_attention_inv_freq, rot.full_attention_attention_scaling
            else:
                from transformers import Qwen3Config
                from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

                tc = Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                                 num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, num_hidden_layers=1,
                                 layer_types=["full_attention"], rope_parameters=p, **mpe)
                rot = Qwen3RotaryEmbedding(tc)
                inv, scale = rot.inv_freq, rot.attention_scaling
    except Exception as e:  # transformers' own validation (a missing factor, ...)
        raise DraftConfigError(f"RoPE parameters {c.rope_parameters} of the {c.layer} layer: transformers' rotary "
                               f"embedding rejects them ({type(e).__name__}: {e})") from None
    finally:
        log.setLevel(level)
    inv = inv.detach().to(torch.float32).clone()
    if inv.shape != (c.head_dim // 2,):
        raise DraftConfigError(f"RoPE parameters {c.rope_parameters}: {inv.numel()} frequencies for head_dim "
                               f"{c.head_dim} (needs {c.head_dim // 2})")
    return inv, float(scale)


def activation(name, field_name: str, source: str):
    from transformers.activations import ACT2FN

    if not isinstance(name, str) or name not in ACT2FN:
        raise DraftConfigError(f"{source}: {field_name} {name!r} is not an activation of transformers' ACT2FN "
                               f"(known: {sorted(ACT2FN)})")
    if any(True for _ in ACT2FN[name].parameters()):
        raise DraftConfigError(f"{source}: {field_name} {name!r} has learnable parameters, which DeepSpec's MLP "
                               "checkpoints do not hold; not implemented")
    return name
