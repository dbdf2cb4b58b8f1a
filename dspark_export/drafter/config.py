"""The DSpark drafter's configuration (:class:`DSparkConfig`): DeepSpec's draft ``config.json`` parsed and checked.

Strict: every field is read, accepted only with the values the layer implements, accepted and ignored for a stated
reason, or refused with a :class:`DraftConfigError` naming it (the tables: :mod:`dspark_export.drafter.families`).
The layer family (``Qwen3DSparkModel`` / ``Gemma4DSparkModel``) is decided here, its RoPE table (transformers' own
rotary classes) and activation by the readers shared with the EAGLE-3 configs (:mod:`dspark_export.drafter.config_fields`); the torch modules that use them are :mod:`dspark_export.drafter.model`. A config
round-trips: :meth:`DSparkConfig.to_dict` writes back the file as read, with the DSpark fields' current values.
DeepSpec's DFlash configs (``markov_rank`` 0, ``enable_confidence_head`` false, neither ``markov_head_type`` nor
``confidence_head_with_markov``) are DSpark configs without both heads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from dspark_export.drafter.config_fields import (DraftConfigError, activation, bool_field, int_field,
                                                 read_config_json, rope_parameters, rotary_table)
from dspark_export.drafter.families import (ARCHITECTURES, CONDITIONAL_FIELDS, DSPARK_FIELDS, GEMMA4, IGNORED_BY_LAYER,
                                            IGNORED_FIELDS, MARKOV_TYPES, MODEL_TYPES, MOE_FIELDS, QWEN3,
                                            REQUIRED_BY_LAYER, REQUIRED_FIELDS, USED_FIELDS)


def _family(d: dict, source: str) -> str:
    arch = d.get("architectures")
    mt = d.get("model_type")
    if arch is None:
        fam = GEMMA4 if isinstance(mt, str) and mt in MODEL_TYPES[GEMMA4] else QWEN3
    else:
        if not isinstance(arch, list) or len(arch) != 1 or arch[0] not in ARCHITECTURES:
            raise DraftConfigError(
                f"{source}: architectures {arch!r} is not a DSpark drafter this loader implements; it loads "
                f"DeepSpec's {QWEN3} and {GEMMA4} (one of them, as DeepSpec writes it). DeepSpec's Eagle-3 "
                "drafters are a different model")
        fam = arch[0]
    if mt is not None and mt not in MODEL_TYPES[fam]:
        raise DraftConfigError(
            f"{source}: model_type {mt!r} with the {fam} layer is not implemented (that layer accepts model_type "
            f"{list(MODEL_TYPES[fam])}); a drafter for that family needs its own layer in dspark_export/drafter/model.py")
    return fam


def _check_fields(d: dict, fam: str, source: str) -> None:
    known = (set(USED_FIELDS[fam]) | set(CONDITIONAL_FIELDS[fam]) | set(IGNORED_FIELDS)
             | set(IGNORED_BY_LAYER[fam]))
    unknown = [k for k in d if k not in known]
    if unknown:
        k = unknown[0]
        others = f" (and {unknown[1:]})" if len(unknown) > 1 else ""
        raise DraftConfigError(
            f"{source}: config field {k!r} = {d[k]!r}{others} is not implemented by this loader's {fam} layer; "
            "loading would ignore it and draft with a different function. Supporting it needs the layer in "
            "dspark_export/drafter/model.py to implement it; remove the field only if you know it does not change "
            "the drafter")


def _moe_fields(d: dict, source: str):
    """(experts, top_k, expert width) of the MoE FFN option (our extension); (0, None, None) = the dense MLP.

    Raises:
        DraftConfigError: a malformed value (the message names the field and its valid range), a missing
            draft_moe_top_k / draft_moe_intermediate_size, or either of them given without experts.
    """
    def _int(name, lo, hi, meaning):
        v = d.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise DraftConfigError(f"{source}: field {name!r} must be an integer {rng} ({meaning}), got {v!r}")
        return v

    experts = d.get("draft_moe_experts")
    if experts is None or (type(experts) is int and experts == 0):
        extra = [k for k in MOE_FIELDS[1:] if k in d]
        if extra:
            raise DraftConfigError(f"{source}: {extra[0]!r} = {d[extra[0]]!r} is given but draft_moe_experts is "
                                   f"{experts!r} (the dense MLP, which has no experts); set draft_moe_experts to the "
                                   f"number of experts (e.g. 8) or remove {extra}")
        return 0, None, None
    experts = _int("draft_moe_experts", 2, None, "experts per draft layer; 0 or absent = the dense MLP, and 1 "
                                                 "expert would be the dense MLP under other tensor names")
    for name, what in (("draft_moe_top_k", "the number of experts mixed per token, e.g. 2"),
                       ("draft_moe_intermediate_size", "each expert's SwiGLU width, e.g. intermediate_size // "
                                                       "draft_moe_top_k")):
        if name not in d:
            raise DraftConfigError(f"{source}: draft_moe_experts {experts} needs {name!r} ({what}); the loader does "
                                   "not guess it, since the checkpoint's shapes and the routing depend on it")
    top_k = _int("draft_moe_top_k", 1, experts, f"experts mixed per token, at most draft_moe_experts = {experts}")
    width = _int("draft_moe_intermediate_size", 1, None, "each expert's SwiGLU width")
    return experts, top_k, width


@dataclass
class DSparkConfig:
    """A DSpark drafter's configuration; reads and writes DeepSpec's draft ``config.json``.

    DeepSpec configs are a copy of the whole target config plus the DSpark fields. The dataclass fields are the
    values the drafter uses (for Gemma-4: ``head_dim`` = ``global_head_dim``, ``num_key_value_heads`` = the
    KV heads of its full-attention layers); ``source`` keeps the config.json as read so a round trip writes
    it back unchanged.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: list
    mask_token_id: int
    markov_rank: int
    markov_head_type: str | None = None
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512
    num_target_layers: int | None = None
    draft_vocab_size: int | None = None  # our extension: reduced draft vocabulary
    frozen_from_target: bool = False  # our extension: embed_tokens / lm_head omitted from the weights
    draft_moe_experts: int = 0  # our extension: experts per draft layer's MoE FFN (0 = the dense MLP)
    draft_moe_top_k: int | None = None  # our extension: experts mixed per token (1..draft_moe_experts)
    draft_moe_intermediate_size: int | None = None  # our extension: each expert's SwiGLU width
    layer: str = QWEN3  # the layer family: QWEN3 | GEMMA4 (DeepSpec's class name)
    attention_bias: bool = False
    hidden_act: str = "silu"
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int | None = None
    attention_k_eq_v: bool = False  # Gemma-4: keys double as values (no v_proj)
    final_logit_softcapping: float | None = None  # Gemma-4: tanh soft cap of the base logits
    source: dict = field(default_factory=dict)
    rope_inv_freq: torch.Tensor | None = field(default=None, repr=False, compare=False)
    rope_attention_scaling: float = 1.0

    @property
    def gemma(self) -> bool:
        return self.layer == GEMMA4

    @property
    def moe(self) -> bool:
        """Whether every draft layer's FFN is the Mixture of Experts (:class:`dspark_model.DraftMoE`)."""
        return self.draft_moe_experts > 0

    @property
    def attention_scale(self) -> float:
        """Multiplier of the q·k scores: head_dim^-1/2 (Qwen3), 1.0 (Gemma-4, whose q/k are RMS-normed)."""
        return 1.0 if self.gemma else self.head_dim ** -0.5

    @property
    def embed_scale(self) -> float | None:
        """Gemma-4 multiplies the embeddings by sqrt(hidden_size); None = no scaling."""
        return float(self.hidden_size) ** 0.5 if self.gemma else None

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "DSparkConfig":
        """Validate a DeepSpec draft config dict.

        Raises:
            DraftConfigError: a required field is missing or malformed, or a field or value is not implemented
                (the message names it and what would support it).
        """
        if not isinstance(d, dict):
            raise DraftConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        fam = _family(d, source)
        missing = [k for k in REQUIRED_FIELDS + REQUIRED_BY_LAYER[fam] if k not in d]
        if missing:
            raise DraftConfigError(f"{source}: missing DSpark/target field(s) {missing}; a DeepSpec draft config "
                                   f"is the target's config plus {list(DSPARK_FIELDS)}")
        _check_fields(d, fam, source)

        _int, _bool = partial(int_field, d, source), partial(bool_field, d, source)

        ids = d["target_layer_ids"]
        if (not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
                or any(b <= a for a, b in zip(ids, ids[1:])) or min(ids) < -1):
            raise DraftConfigError(f"{source}: 'target_layer_ids' must be a non-empty strictly increasing list of "
                                   f"layer indices >= -1 (-1 = embedding output), got {ids!r}")
        # markov_rank 0 and enable_confidence_head false together are DeepSpec's DFlash (its DFlash recipes: no
        # Markov head, no confidence head). DeepSpec's build_draft_config writes markov_head_type only when
        # markov_rank > 0 and confidence_head_with_markov only with the confidence head; given without them they
        # describe a head the drafter does not have, so they are refused rather than dropped.
        rank = _int("markov_rank", 0)
        mtype = d.get("markov_head_type")
        if rank > 0 and mtype not in MARKOV_TYPES:
            raise DraftConfigError(f"{source}: 'markov_head_type' must be one of {list(MARKOV_TYPES)} when "
                                   f"markov_rank > 0, got {mtype!r}")
        if rank == 0 and mtype is not None:
            raise DraftConfigError(f"{source}: 'markov_head_type' {mtype!r} is given but markov_rank is 0 (no Markov "
                                   "head, as DeepSpec's DFlash drafters); DeepSpec writes markov_head_type only when "
                                   "markov_rank > 0. Remove it, or give the head's markov_rank")
        conf = _bool("enable_confidence_head", True)
        with_markov = _bool("confidence_head_with_markov", False) if conf else False
        if conf and "confidence_head_with_markov" not in d:
            raise DraftConfigError(f"{source}: 'confidence_head_with_markov' must be given when "
                                   "enable_confidence_head is true")
        if not conf and d.get("confidence_head_with_markov") is not None:
            raise DraftConfigError(f"{source}: 'confidence_head_with_markov' "
                                   f"{d['confidence_head_with_markov']!r} is given but enable_confidence_head is "
                                   "false (no confidence head, as DeepSpec's DFlash drafters); DeepSpec writes it "
                                   "only with the confidence head. Remove it, or set enable_confidence_head true")
        if with_markov and rank == 0:
            raise DraftConfigError(f"{source}: confidence_head_with_markov needs markov_rank > 0")
        heads = _int("num_attention_heads", 1)
        hidden = _int("hidden_size", 1)
        n_layers = _int("num_hidden_layers", 1)
        vocab = _int("vocab_size", 1)
        mask_id = _int("mask_token_id", 0)
        if mask_id >= vocab:
            raise DraftConfigError(f"{source}: mask_token_id {mask_id} is outside the vocabulary (size {vocab})")
        ntl = d.get("num_target_layers")
        if ntl is not None and max(ids) >= ntl:
            raise DraftConfigError(f"{source}: target_layer_ids {ids} exceed num_target_layers={ntl}")
        dvs = d.get("draft_vocab_size")
        if dvs is not None and (isinstance(dvs, bool) or not isinstance(dvs, int) or not 0 < dvs <= vocab):
            raise DraftConfigError(f"{source}: draft_vocab_size must be an integer in 1..{vocab}, got {dvs!r}")
        bias = _bool("attention_bias", False)
        if _bool("tie_word_embeddings", False):
            raise DraftConfigError(f"{source}: tie_word_embeddings true is not implemented: DeepSpec drafters hold "
                                   "an untied lm_head (DeepSpec writes tie_word_embeddings false)")
        lt = d.get("layer_types")
        if lt is not None:
            if not isinstance(lt, list) or len(lt) < n_layers:
                raise DraftConfigError(f"{source}: layer_types must list one entry per draft layer "
                                       f"({n_layers}), got {lt!r}")
            bad = [(i, t) for i, t in enumerate(lt[:n_layers]) if t != "full_attention"]
            if bad:
                raise DraftConfigError(
                    f"{source}: layer_types[{bad[0][0]}] = {bad[0][1]!r} is not implemented: every draft layer "
                    "attends to the whole context (DeepSpec writes 'full_attention' for each draft layer); a "
                    "sliding-window draft layer would need its window in the graph's attention mask")
        mpe = d.get("max_position_embeddings")
        if mpe is not None:
            mpe = _int("max_position_embeddings", 1)
        kv = _int("num_key_value_heads", 1)
        k_eq_v, softcap = False, None
        if fam == QWEN3:
            head_dim = d.get("head_dim") or hidden // heads
            act = activation(d.get("hidden_act", "silu"), "hidden_act", source)
            if _bool("mlp_bias", False):
                raise DraftConfigError(f"{source}: mlp_bias true is not implemented: DeepSpec's Qwen3 DSpark MLP has "
                                       "no biases")
            if lt is None and _bool("use_sliding_window", False):
                raise DraftConfigError(f"{source}: use_sliding_window true (without layer_types) is not implemented: "
                                       "every draft layer attends to the whole context")
        else:
            head_dim = _int("global_head_dim", 1)
            act = activation(d["hidden_activation"], "hidden_activation", source)
            k_eq_v = _bool("attention_k_eq_v", False)
            if k_eq_v:
                if "num_global_key_value_heads" not in d:
                    raise DraftConfigError(f"{source}: attention_k_eq_v true needs num_global_key_value_heads (the "
                                           "KV heads of Gemma-4's full-attention layers)")
                kv = _int("num_global_key_value_heads", 1)
            if _bool("enable_moe_block", False):
                raise DraftConfigError(f"{source}: enable_moe_block true is not implemented: Gemma-4 MoE blocks are "
                                       "not part of DeepSpec's Gemma-4 DSpark layer (it refuses them too)")
            if d.get("hidden_size_per_layer_input") not in (None, 0):
                raise DraftConfigError(f"{source}: hidden_size_per_layer_input {d['hidden_size_per_layer_input']!r} "
                                       "is not implemented: Gemma-4 per-layer inputs are not part of DeepSpec's "
                                       "Gemma-4 DSpark layer (it refuses them too); it must be 0")
            shared = d.get("num_kv_shared_layers") or 0
            if _bool("use_double_wide_mlp", False) and shared:
                raise DraftConfigError(f"{source}: use_double_wide_mlp true with num_kv_shared_layers {shared} is "
                                       "not implemented: the MLP width of KV-shared layers depends on the "
                                       "transformers version's sharing layout")
            plc = d.get("per_layer_config")
            if plc is not None and (not isinstance(plc, dict) or any(
                    not isinstance(v, dict) or v.get("head_dim", head_dim) != head_dim
                    or v.get("num_key_value_heads", kv) != kv or set(v) - {"head_dim", "num_key_value_heads"}
                    for v in plc.values())):
                raise DraftConfigError(f"{source}: per_layer_config {plc!r} differs from global_head_dim {head_dim} "
                                       f"/ {kv} KV heads; per-layer shapes are not implemented")
            softcap = d.get("final_logit_softcapping")
            if softcap is not None:
                if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0:
                    raise DraftConfigError(f"{source}: final_logit_softcapping must be a positive number or null, "
                                           f"got {softcap!r}")
                softcap = float(softcap)
        if heads % kv:
            raise DraftConfigError(f"{source}: num_attention_heads {heads} is not a multiple of the {kv} KV heads")
        if int(head_dim) % 2:
            raise DraftConfigError(f"{source}: head size {head_dim} must be even (RoPE)")
        rope = rope_parameters(d, fam, source)
        moe_e, moe_k, moe_i = _moe_fields(d, source)
        c = cls(hidden_size=hidden, intermediate_size=_int("intermediate_size", 1),
                num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=int(head_dim), vocab_size=vocab, rms_norm_eps=float(d["rms_norm_eps"]),
                rope_theta=float(rope["rope_theta"]), block_size=_int("block_size", 1), target_layer_ids=list(ids),
                mask_token_id=mask_id, markov_rank=rank, markov_head_type=mtype if rank > 0 else None,
                enable_confidence_head=conf, confidence_head_with_markov=with_markov,
                num_anchors=int(d.get("num_anchors", 512)), num_target_layers=ntl, draft_vocab_size=dvs,
                frozen_from_target=bool(d.get("frozen_from_target", False)), layer=fam, attention_bias=bias,
                hidden_act=act, rope_parameters=rope, max_position_embeddings=mpe, attention_k_eq_v=k_eq_v,
                final_logit_softcapping=softcap, draft_moe_experts=moe_e, draft_moe_top_k=moe_k,
                draft_moe_intermediate_size=moe_i, source=json.loads(json.dumps(d)))
        try:
            c.rope_inv_freq, c.rope_attention_scaling = rotary_table(c)
        except DraftConfigError as e:
            raise DraftConfigError(f"{source}: {e}") from None
        return c

    def to_dict(self) -> dict:
        """The DeepSpec-style config.json dict: the config as read, with the DSpark fields' current values."""
        d = json.loads(json.dumps(self.source))
        d.setdefault("architectures", [self.layer])
        d.setdefault("model_type", "gemma4_text" if self.gemma else "qwen3")
        for k in DSPARK_FIELDS + ("draft_vocab_size",):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.markov_head_type is None:
            d.pop("markov_head_type", None)
        if not self.enable_confidence_head:  # DeepSpec writes it only with the confidence head (DFlash: neither)
            d.pop("confidence_head_with_markov", None)
        if not self.draft_vocab_size:
            d.pop("draft_vocab_size", None)
        if self.frozen_from_target:
            d["frozen_from_target"] = True
        else:
            d.pop("frozen_from_target", None)
        for k in MOE_FIELDS:  # written only when the MoE FFN is on: a dense config keeps exactly its old fields
            if self.moe:
                d[k] = getattr(self, k)
            else:
                d.pop(k, None)
        return d

    @property
    def out_vocab(self) -> int:
        """Size of the drafter's output vocabulary (V_d if reduced, else the target's)."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features, m·d."""
        return len(self.target_layer_ids) * self.hidden_size


def load_config(path: Path) -> DSparkConfig:
    """Read a draft ``config.json`` (a folder or the file itself).

    Raises:
        DraftConfigError: missing file, bad JSON, a missing/malformed DSpark field, or a field or value the
            drafter does not implement.
    """
    d, source = read_config_json(path, "DSpark")
    return DSparkConfig.from_dict(d, source=source)
