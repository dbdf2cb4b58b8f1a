"""The DSpark drafter in torch: configuration, model, and DeepSpec-layout checkpoints.

Architecture (docs/design.md §1; DSpark paper §3; DeepSpec ``deepspec/modeling/dspark/qwen3/modeling.py`` and
``deepspec/modeling/dspark/gemma4/modeling.py``):

- **Context (KV injection).** The target's hidden states at layers ``target_layer_ids`` (DeepSpec
  indexing: -1 = embedding output, i = output of decoder layer i) are concatenated per committed
  position, projected ``fc: m·d -> d`` and RMS-normalised (``hidden_norm``). Every draft layer applies
  its own ``k_proj``/``v_proj`` to them; ``k_norm`` and RoPE (at the context positions) apply to the
  context keys too. The context of a block is every committed position before its anchor.
- **Block.** Input = the anchor token followed by γ−1 ``mask_token_id`` tokens at positions
  anchor_pos .. anchor_pos+γ−1, embedded with the target's (frozen) embedding. Block positions attend to
  all context positions and bidirectionally to each other. Block position k (0-based) predicts the token
  at anchor_pos + k + 1, so a block of γ positions drafts γ tokens. Output hidden states are normed
  (``norm``) and give base logits U_k = lm_head(h_k) with the target's (frozen) LM head.
- **Markov head** (sequential stage): logits_k = U_k + W2·f(W1[x_{k−1}], h_k, ...) with x_{−1} = anchor;
  ``vanilla`` f = identity, ``gated`` f = σ(W_g[h_k; W1[x]])⊙W1[x], ``rnn`` a GRU-like state over the block.
  ``markov_rank`` 0 = no head (DFlash).
- **Confidence head**: c_k = σ(wᵀ[h_k; W1[x_{k−1}]] + b) (or σ(wᵀh_k + b) without Markov features),
  trained to the soft acceptance 1 − ½‖p_d − p_t‖₁.

**Two layer families**, chosen by ``architectures`` (DeepSpec's model class names):

- ``Qwen3DSparkModel`` (DeepSpec's Qwen3 layer; also what our own drafters for Qwen2/Llama/Mistral targets
  use): pre-norm residual blocks, q/k RMSNorm (x·rsqrt(mean x²+ε)·w), q/k/v/o biases iff ``attention_bias``,
  the MLP activation ``hidden_act`` (transformers' ``ACT2FN``), scores scaled by head_dim^-½, RoPE from
  ``rope_parameters``/``rope_scaling``/``rope_theta`` through transformers' own ``Qwen3RotaryEmbedding``
  (types ``default``, ``linear``, ``yarn``, ``llama3``; the YaRN attention factor multiplies cos/sin).
- ``Gemma4DSparkModel`` (DeepSpec's Gemma-4 layer): head size ``global_head_dim``; keys double as values when
  ``attention_k_eq_v`` (no ``v_proj``; then ``num_global_key_value_heads`` KV heads); q/k RMSNorm with weight
  and a weightless v RMSNorm (Gemma-4 norms multiply by ``weight``, not 1 + weight, computed in float32);
  scores unscaled (scaling 1.0); sandwich norms: x + post_attention_layernorm(attn(input_layernorm(x))),
  then x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))), the layer output times
  ``layer_scalar``; embeddings times sqrt(hidden_size) (in the weights' dtype, the mask token too);
  MLP activation ``hidden_activation``; RoPE of ``rope_parameters["full_attention"]`` through transformers'
  ``Gemma4TextRotaryEmbedding`` (``proportional`` or ``default``); base logits soft-capped,
  tanh(U/cap)·cap with cap = ``final_logit_softcapping``, before the Markov bias.

**Strict loading.** Every config.json field is either read (:data:`USED_FIELDS`), accepted and ignored
for a stated reason (:data:`IGNORED_FIELDS`, :data:`CONDITIONAL_FIELDS`), or refused with a
:class:`DraftConfigError` naming it; every checkpoint tensor must be consumed and every model tensor filled.

Parameter names are DeepSpec's: ``fc``, ``hidden_norm``, ``layers.N.self_attn.{q,k,v,o}_proj`` (+ ``.bias``),
``layers.N.self_attn.{q,k}_norm``, ``layers.N.mlp.{gate,up,down}_proj``, ``layers.N.{input,post_attention}_layernorm``
(+ Gemma-4: ``layers.N.{pre,post}_feedforward_layernorm``, ``layers.N.layer_scalar``), ``norm``, ``embed_tokens``,
``lm_head``, ``markov_head.markov_w1``/``markov_w2`` (+ ``gate_proj``/``joint_proj``), ``confidence_head.proj``.

**Reduced draft vocabulary** (our extension, recorded, exact): with ``draft_vocab_size`` = V_d set, the
drafter scores only the target ids ``draft_vocab_ids`` (int64 [V_d], stored in the checkpoint); draft
token i means target id draft_vocab_ids[i]. ``lm_head`` then holds those V_d rows of the target's head,
``markov_w2`` is [V_d, r] and ``markov_w1`` is [V_d + 1, r] where the last row embeds every previous token
outside the draft vocabulary. Frozen copies of the target's embedding and LM head may be omitted from the
checkpoint (``frozen_from_target``); they are then taken from the target at load time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dspark_runtime.errors import DSparkError

WEIGHTS_NAME = "model.safetensors"

# DSpark fields of a DeepSpec draft config.json (the rest is a copy of the target's config).
DSPARK_FIELDS = ("block_size", "target_layer_ids", "mask_token_id", "num_hidden_layers", "markov_rank",
                 "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_anchors",
                 "num_target_layers")
REQUIRED_FIELDS = ("block_size", "target_layer_ids", "mask_token_id", "num_hidden_layers", "markov_rank",
                   "enable_confidence_head", "hidden_size", "intermediate_size", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "rms_norm_eps")
MARKOV_TYPES = ("vanilla", "gated", "rnn")

QWEN3 = "Qwen3DSparkModel"
GEMMA4 = "Gemma4DSparkModel"
ARCHITECTURES = (QWEN3, GEMMA4)
# model_type values each layer family accepts (DeepSpec copies the target's; our own drafters for Qwen2/Llama/
# Mistral targets use DeepSpec's Qwen3 layer).
MODEL_TYPES = {QWEN3: ("qwen3", "qwen2", "llama", "mistral"), GEMMA4: ("gemma4_text", "gemma4_unified_text")}
REQUIRED_BY_LAYER = {QWEN3: (), GEMMA4: ("global_head_dim", "hidden_activation", "rope_parameters", "attention_k_eq_v")}

# RoPE types implemented (inv_freq and attention scaling from transformers' own rotary embedding of the
# family), the keys each may carry besides rope_type/rope_theta, and the types refused with the reason.
ROPE_TYPES = {QWEN3: ("default", "linear", "yarn", "llama3"), GEMMA4: ("default", "proportional")}
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "proportional": ("factor", "partial_rotary_factor"),
}
ROPE_REFUSED = {
    "dynamic": "dynamic NTK recomputes the frequencies from the current sequence length at every call, so keys "
               "cached in earlier rounds would carry other frequencies than the new ones; a fixed ONNX graph with "
               "a reused context cache cannot reproduce that faithfully",
    "longrope": "LongRoPE switches between its short and long factors by the current sequence length, which a "
                "fixed ONNX graph with a reused context cache cannot reproduce faithfully",
}

# config.json fields read by the drafter, per layer family.
_COMMON_USED = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps", "attention_bias",
                "rope_parameters", "max_position_embeddings", "layer_types", "tie_word_embeddings", "block_size",
                "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head",
                "confidence_head_with_markov", "num_target_layers", "draft_vocab_size", "frozen_from_target")
USED_FIELDS = {
    QWEN3: _COMMON_USED + ("head_dim", "hidden_act", "rope_theta", "rope_scaling", "original_max_position_embeddings"),
    GEMMA4: _COMMON_USED + ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "hidden_activation",
                            "final_logit_softcapping"),
}
# Fields accepted only with the values the drafter implements (checked in DSparkConfig.from_dict).
CONDITIONAL_FIELDS = {
    QWEN3: {
        "mlp_bias": "must be false (DeepSpec's Qwen3 MLP has no biases)",
        "use_sliding_window": "ignored when layer_types is given (DeepSpec's layer reads layer_types); must be "
                              "false otherwise",
        "sliding_window": "ignored: it applies only to 'sliding_attention' layers, which are refused",
        "max_window_layers": "ignored: it only derives layer_types when those are absent (use_sliding_window false)",
    },
    GEMMA4: {
        "enable_moe_block": "must be false (DeepSpec's Gemma-4 DSpark layer refuses MoE blocks)",
        "hidden_size_per_layer_input": "must be 0 or null (per-layer inputs; DeepSpec's Gemma-4 DSpark layer "
                                       "refuses them)",
        "use_double_wide_mlp": "must be false when num_kv_shared_layers > 0 (the MLP width of KV-shared layers "
                               "then depends on the transformers version's sharing layout)",
        "num_kv_shared_layers": "ignored when use_double_wide_mlp is false: DeepSpec's drafter attention never "
                                "shares keys/values between layers",
        "per_layer_config": "(transformers' newer layout) accepted only when every entry repeats global_head_dim "
                            "and the KV head count",
        "sliding_window": "ignored: it applies only to 'sliding_attention' layers, which are refused",
    },
}
# Fields accepted and not read, with why that is safe.
IGNORED_FIELDS = {
    "attention_dropout": "dropout, off at inference (DeepSpec evaluates with it off)",
    "initializer_range": "weight initialisation only",
    "bos_token_id": "tokenizer id; the drafter never reads it",
    "eos_token_id": "tokenizer id; the drafter never reads it",
    "pad_token_id": "tokenizer id; in DeepSpec only nn.Embedding's padding_idx, which changes gradients, not outputs",
    "use_cache": "generation flag of the target",
    "torch_dtype": "storage dtype; each tensor's own dtype is read and cast to load_checkpoint(dtype=...)",
    "dtype": "storage dtype; each tensor's own dtype is read and cast to load_checkpoint(dtype=...)",
    "transformers_version": "provenance",
    "_name_or_path": "provenance",
    "_model_name_or_path": "provenance (the GGUF a target was converted from)",
    "num_anchors": "training only (anchors sampled per sequence)",
    "_attn_implementation": "attention kernel choice (eager/sdpa/flex): the same function",
    "pretraining_tp": "Llama's tensor-parallel split of the target's matmuls (the same function); the drafter "
                      "layer never reads it",
    "id2label": "Hugging Face bookkeeping (classification heads)",
    "label2id": "Hugging Face bookkeeping (classification heads)",
    "problem_type": "Hugging Face bookkeeping (classification heads)",
    "output_attentions": "Hugging Face output flag",
    "output_hidden_states": "Hugging Face output flag",
    "return_dict": "Hugging Face output flag",
    "chunk_size_feed_forward": "Hugging Face bookkeeping; DeepSpec's layers do not read it",
    "is_encoder_decoder": "Hugging Face bookkeeping; DeepSpec's layers do not read it",
    "tokenizer_class": "tokenizer bookkeeping",
}
IGNORED_BY_LAYER = {
    QWEN3: {},
    GEMMA4: {
        "head_dim": "the sliding-attention head size; every draft layer is full attention with global_head_dim",
        "use_bidirectional_attention": "the target's causal switch; the DSpark block mask sets the drafter's "
                                       "attention",
        "vocab_size_per_layer_input": "per-layer input embeddings, off (hidden_size_per_layer_input = 0)",
        "num_experts": "MoE, off (enable_moe_block false)",
        "top_k_experts": "MoE, off (enable_moe_block false)",
        "moe_intermediate_size": "MoE, off (enable_moe_block false)",
        "target_model_type": "provenance DeepSpec records",
        "target_text_model_type": "provenance DeepSpec records",
    },
}


class DraftConfigError(DSparkError):
    """A DSpark draft config.json or checkpoint is missing a field or tensor, has a malformed one, or holds a
    value or tensor this loader does not implement (the message names it and what would support it)."""


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
            f"{list(MODEL_TYPES[fam])}); a drafter for that family needs its own layer in dspark_export/dspark_model.py")
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
            "dspark_export/dspark_model.py to implement it; remove the field only if you know it does not change "
            "the drafter")


def _rope_parameters(d: dict, fam: str, source: str) -> dict:
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


def rotary_table(c: "DSparkConfig"):
    """(inv_freq float32 [head_dim/2], attention scaling) of the draft layers' RoPE, from transformers' own
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


def _activation(name, field_name: str, source: str):
    from transformers.activations import ACT2FN

    if not isinstance(name, str) or name not in ACT2FN:
        raise DraftConfigError(f"{source}: {field_name} {name!r} is not an activation of transformers' ACT2FN "
                               f"(known: {sorted(ACT2FN)})")
    if any(True for _ in ACT2FN[name].parameters()):
        raise DraftConfigError(f"{source}: {field_name} {name!r} has learnable parameters, which DeepSpec's MLP "
                               "checkpoints do not hold; not implemented")
    return name


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

        def _int(name, lo=None, default=None):
            v = d.get(name, default)
            if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
                raise DraftConfigError(f"{source}: field {name!r} must be an integer"
                                       f"{f' >= {lo}' if lo is not None else ''}, got {v!r}")
            return v

        def _bool(name, default):
            v = d.get(name, default)
            if not isinstance(v, bool):
                raise DraftConfigError(f"{source}: field {name!r} must be true or false, got {v!r}")
            return v

        ids = d["target_layer_ids"]
        if (not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
                or any(b <= a for a, b in zip(ids, ids[1:])) or min(ids) < -1):
            raise DraftConfigError(f"{source}: 'target_layer_ids' must be a non-empty strictly increasing list of "
                                   f"layer indices >= -1 (-1 = embedding output), got {ids!r}")
        rank = _int("markov_rank", 0)
        mtype = d.get("markov_head_type")
        if rank > 0 and mtype not in MARKOV_TYPES:
            raise DraftConfigError(f"{source}: 'markov_head_type' must be one of {list(MARKOV_TYPES)} when "
                                   f"markov_rank > 0, got {mtype!r}")
        conf = _bool("enable_confidence_head", True)
        with_markov = _bool("confidence_head_with_markov", False) if conf else False
        if conf and "confidence_head_with_markov" not in d:
            raise DraftConfigError(f"{source}: 'confidence_head_with_markov' must be given when "
                                   "enable_confidence_head is true")
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
            act = _activation(d.get("hidden_act", "silu"), "hidden_act", source)
            if _bool("mlp_bias", False):
                raise DraftConfigError(f"{source}: mlp_bias true is not implemented: DeepSpec's Qwen3 DSpark MLP has "
                                       "no biases")
            if lt is None and _bool("use_sliding_window", False):
                raise DraftConfigError(f"{source}: use_sliding_window true (without layer_types) is not implemented: "
                                       "every draft layer attends to the whole context")
        else:
            head_dim = _int("global_head_dim", 1)
            act = _activation(d["hidden_activation"], "hidden_activation", source)
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
        rope = _rope_parameters(d, fam, source)
        c = cls(hidden_size=hidden, intermediate_size=_int("intermediate_size", 1),
                num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv,
                head_dim=int(head_dim), vocab_size=vocab, rms_norm_eps=float(d["rms_norm_eps"]),
                rope_theta=float(rope["rope_theta"]), block_size=_int("block_size", 1), target_layer_ids=list(ids),
                mask_token_id=mask_id, markov_rank=rank, markov_head_type=mtype if rank > 0 else None,
                enable_confidence_head=conf, confidence_head_with_markov=with_markov,
                num_anchors=int(d.get("num_anchors", 512)), num_target_layers=ntl, draft_vocab_size=dvs,
                frozen_from_target=bool(d.get("frozen_from_target", False)), layer=fam, attention_bias=bias,
                hidden_act=act, rope_parameters=rope, max_position_embeddings=mpe, attention_k_eq_v=k_eq_v,
                final_logit_softcapping=softcap, source=json.loads(json.dumps(d)))
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
        if not self.draft_vocab_size:
            d.pop("draft_vocab_size", None)
        if self.frozen_from_target:
            d["frozen_from_target"] = True
        else:
            d.pop("frozen_from_target", None)
        return d

    @property
    def out_vocab(self) -> int:
        """Size of the drafter's output vocabulary (V_d if reduced, else the target's)."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features, m·d."""
        return len(self.target_layer_ids) * self.hidden_size


class RMSNorm(nn.Module):
    """RMSNorm, computed in float32.

    ``gemma=False`` (Qwen2/3): weight · (x · rsqrt(mean(x²) + eps)) cast back to x's dtype first.
    ``gemma=True`` (Gemma-4): (x · (mean(x²) + eps)^-½ · weight) in float32, then cast; ``with_scale=False``
    drops the weight (Gemma-4's v-norm). Gemma-4 multiplies by ``weight`` itself (Gemma 1-3 used 1 + weight).
    """

    def __init__(self, dim: int, eps: float, *, gemma: bool = False, with_scale: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.eps = eps
        self.gemma = gemma

    def forward(self, x):
        dt = x.dtype
        xf = x.float()
        if self.gemma:
            y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
            if self.weight is not None:
                y = y * self.weight.float()
            return y.to(dt)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(dt)


def rope(x, positions, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """Rotary embedding (rotate-half convention) of x [b, h, n, hd] at integer positions [b, n].

    ``inv_freq`` float32 [hd/2] (from :func:`rotary_table`); cos/sin are computed in float32, multiplied by
    ``attention_scaling`` (YaRN's attention factor; 1 otherwise) and cast to x's dtype, as transformers does.
    """
    hd = x.shape[-1]
    ang = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(x.device)  # [b, n, hd/2]
    emb = torch.cat([ang, ang], dim=-1).unsqueeze(1)  # [b, 1, n, hd]
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftAttention(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.c = c
        h, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        b = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, h * hd, bias=b)
        self.k_proj = nn.Linear(c.hidden_size, kv * hd, bias=b)
        self.v_proj = None if c.attention_k_eq_v else nn.Linear(c.hidden_size, kv * hd, bias=b)
        self.o_proj = nn.Linear(h * hd, c.hidden_size, bias=b)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps, gemma=c.gemma)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps, gemma=c.gemma)
        self.v_norm = RMSNorm(hd, c.rms_norm_eps, gemma=True, with_scale=False) if c.gemma else None

    def _rope(self, x, positions):
        return rope(x, positions, self.c.rope_inv_freq, self.c.rope_attention_scaling)

    def kv(self, x, positions):
        """Keys/values of x [b, n, d] at positions [b, n] -> ([b, kvh, n, hd], [b, kvh, n, hd])."""
        b, n, _ = x.shape
        c = self.c
        k = self.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim)
        if self.v_norm is not None:
            v = self.v_norm(v)
        k = self.k_norm(k).transpose(1, 2)
        return self._rope(k, positions), v.transpose(1, 2)

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        """x [b, q, d] block states; ctx_k/v [b, kvh, C, hd]; mask bool [b, 1, q, C+q] (True = attend)."""
        b, q, _ = x.shape
        c = self.c
        qs = self.q_norm(self.q_proj(x).view(b, q, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        qs = self._rope(qs, positions)
        bk, bv = self.kv(x, positions)
        k = torch.cat([ctx_k, bk], dim=2)
        v = torch.cat([ctx_v, bv], dim=2)
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(qs, k.transpose(-1, -2))
        if c.attention_scale != 1.0:
            scores = scores * c.attention_scale
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


class DraftMLP(nn.Module):
    """down(act(gate(x)) · up(x)) with act = transformers' ``ACT2FN[hidden_act]`` (no biases)."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act_fn = ACT2FN[c.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.gemma = c.gemma
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, gemma=c.gemma)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, gemma=c.gemma)
        if c.gemma:
            self.pre_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, gemma=True)
            self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, gemma=True)
            self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        if not self.gemma:
            x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class MarkovHead(nn.Module):
    """W1 [V_in, r] embedding of the previous token, W2 [V_out, r] projection (+ gate / rnn parameters)."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        r = c.markov_rank
        v_in = c.draft_vocab_size + 1 if c.draft_vocab_size else c.vocab_size
        self.kind = c.markov_head_type
        self.markov_w1 = nn.Embedding(v_in, r)
        self.markov_w2 = nn.Linear(r, c.out_vocab, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(c.hidden_size + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + c.hidden_size, 3 * r)

    def latent(self, prev_in, h, state=None):
        """Rank-r latent for one step: prev_in int64 [...] (W1 row ids), h [..., d] -> (latent [..., r], state)."""
        e = self.markov_w1(prev_in)
        if self.kind == "vanilla":
            return e, state
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e, state
        if state is None:
            state = torch.zeros_like(e)
        g, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        state = g * state + (1 - g) * torch.tanh(cand)
        return torch.tanh(out), state

    def block_latents(self, prev_in, h):
        """Teacher-forced latents for a block: prev_in [..., γ], h [..., γ, d] -> [..., γ, r]."""
        if self.kind != "rnn":
            return self.latent(prev_in, h)[0]
        state, outs = None, []
        for k in range(prev_in.shape[-1]):
            lat, state = self.latent(prev_in[..., k], h[..., k, :], state)
            outs.append(lat)
        return torch.stack(outs, dim=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1)

    def forward(self, x):
        return self.proj(x).squeeze(-1)


class DSparkDrafter(nn.Module):
    """The DSpark drafter (see the module docstring for the architecture and sources)."""

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DraftLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, gemma=c.gemma)
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, gemma=c.gemma)
        self.lm_head = nn.Linear(c.hidden_size, c.out_vocab, bias=False)
        self.markov_head = MarkovHead(c) if c.markov_rank > 0 else None
        self.confidence_head = None
        if c.enable_confidence_head:
            self.confidence_head = ConfidenceHead(c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0))
        if c.rope_inv_freq is None:
            c.rope_inv_freq, c.rope_attention_scaling = rotary_table(c)
        if c.draft_vocab_size:
            self.register_buffer("draft_vocab_ids", torch.arange(c.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab_ids = None
        self._t2d = None

    # --- vocabulary mapping ---------------------------------------------------------------
    def target_to_draft(self) -> torch.Tensor:
        """int64 [V]: draft index of each target id (V_d = "outside the draft vocabulary"); identity if full."""
        c = self.config
        if self._t2d is None or self._t2d.numel() != c.vocab_size:
            if self.draft_vocab_ids is None:
                self._t2d = torch.arange(c.vocab_size)
            else:
                t2d = torch.full((c.vocab_size,), c.draft_vocab_size, dtype=torch.long)
                t2d[self.draft_vocab_ids] = torch.arange(c.draft_vocab_size)
                self._t2d = t2d
        return self._t2d

    def init_from_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, freeze: bool = True):
        """Copy the target's embedding [V, d] and LM head [V, d] (rows ``draft_vocab_ids`` if reduced)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
            rows = lm_head_weight if self.draft_vocab_ids is None else lm_head_weight[self.draft_vocab_ids]
            self.lm_head.weight.copy_(rows)
        if freeze:
            self.embed_tokens.requires_grad_(False)
            self.lm_head.requires_grad_(False)

    # --- forward pieces ---------------------------------------------------------------------
    def embed(self, ids):
        """Token embeddings [..., d] (Gemma-4: times sqrt(hidden_size), the scale in the weights' dtype)."""
        e = self.embed_tokens(ids)
        s = self.config.embed_scale
        return e if s is None else e * torch.tensor(s, dtype=torch.float32).to(e.dtype)

    def base_logits(self, h):
        """Base logits U_k = lm_head(h_k) (Gemma-4: soft-capped, tanh(U/cap)·cap, as DeepSpec's compute_logits)."""
        logits = self.lm_head(h)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def context_kv(self, features, positions):
        """Per-layer context K/V of target features [b, n, m·d] at positions [b, n] -> [(k, v)] [b, kvh, n, hd]."""
        ctx = self.hidden_norm(self.fc(features))
        return [layer.self_attn.kv(ctx, positions) for layer in self.layers]

    def block_hidden(self, block_ids, positions, ctx_kv, mask):
        """Normed block hidden states [b, q, d] from block token ids [b, q] (anchor, masks...) at positions [b, q].

        ctx_kv: per-layer (k, v) [b, kvh, C, hd]; mask bool [b, 1, q, C + q], True = attend.
        """
        x = self.embed(block_ids)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, positions, k, v, mask)
        return self.norm(x)

    def markov_bias(self, prev_in, h):
        """Markov logit bias [..., γ, V_out] for teacher-forced previous tokens (W1 row ids) [..., γ]."""
        return self.markov_head.markov_w2(self.markov_head.block_latents(prev_in, h))

    def confidence_logits(self, prev_in, h):
        """Pre-sigmoid confidence [..., γ] from h [..., γ, d] and previous tokens (W1 row ids) [..., γ]."""
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov:
            return self.confidence_head(torch.cat([h, self.markov_head.markov_w1(prev_in)], dim=-1))
        return self.confidence_head(h)


def block_mask(anchors, keep, seq_len: int, gamma: int):
    """Training attention mask bool [b, 1, A·γ, L + A·γ] (DeepSpec's dense DSpark mask).

    Block a's queries see context positions < anchors[b, a] and the γ positions of block a; dropped
    blocks (keep False) see nothing but themselves (their loss is masked).
    """
    b, a = anchors.shape
    q = torch.arange(a * gamma, device=anchors.device)
    qb = q // gamma  # [Q]
    kv = torch.arange(seq_len + a * gamma, device=anchors.device)
    anchor_q = anchors[:, qb]  # [b, Q]
    ctx = (kv[None, None, :] < seq_len) & (kv[None, None, :] < anchor_q[:, :, None])
    ctx = ctx & keep[:, qb][:, :, None]
    same = (kv[None, :] >= seq_len) & (((kv[None, :] - seq_len) // gamma) == qb[:, None])
    return (ctx | same[None]).unsqueeze(1)


# --- checkpoints (DeepSpec layout) -------------------------------------------------------------

def expected_shapes(c: DSparkConfig, include_frozen: bool = True) -> dict:
    """Every tensor name of a DeepSpec-layout checkpoint for ``c`` -> its shape."""
    d, hd = c.hidden_size, c.head_dim
    s = {"fc.weight": (d, c.feature_size), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    if include_frozen:
        s["embed_tokens.weight"] = (c.vocab_size, d)
        s["lm_head.weight"] = (c.out_vocab, d)
    projs = {"q_proj": c.num_attention_heads * hd, "k_proj": c.num_key_value_heads * hd}
    if not c.attention_k_eq_v:
        projs["v_proj"] = c.num_key_value_heads * hd
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        for name, rows in projs.items():
            s[p + f"self_attn.{name}.weight"] = (rows, d)
            if c.attention_bias:
                s[p + f"self_attn.{name}.bias"] = (rows,)
        s[p + "self_attn.o_proj.weight"] = (d, c.num_attention_heads * hd)
        if c.attention_bias:
            s[p + "self_attn.o_proj.bias"] = (d,)
        s[p + "self_attn.q_norm.weight"] = (hd,)
        s[p + "self_attn.k_norm.weight"] = (hd,)
        s[p + "mlp.gate_proj.weight"] = (c.intermediate_size, d)
        s[p + "mlp.up_proj.weight"] = (c.intermediate_size, d)
        s[p + "mlp.down_proj.weight"] = (d, c.intermediate_size)
        s[p + "input_layernorm.weight"] = (d,)
        s[p + "post_attention_layernorm.weight"] = (d,)
        if c.gemma:
            s[p + "pre_feedforward_layernorm.weight"] = (d,)
            s[p + "post_feedforward_layernorm.weight"] = (d,)
            s[p + "layer_scalar"] = (1,)
    r = c.markov_rank
    if r > 0:
        s["markov_head.markov_w1.weight"] = (c.draft_vocab_size + 1 if c.draft_vocab_size else c.vocab_size, r)
        s["markov_head.markov_w2.weight"] = (c.out_vocab, r)
        if c.markov_head_type == "gated":
            s["markov_head.gate_proj.weight"] = (r, d + r)
            s["markov_head.gate_proj.bias"] = (r,)
        elif c.markov_head_type == "rnn":
            s["markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
            s["markov_head.joint_proj.bias"] = (3 * r,)
    if c.enable_confidence_head:
        s["confidence_head.proj.weight"] = (1, d + (r if c.confidence_head_with_markov else 0))
        s["confidence_head.proj.bias"] = (1,)
    if c.draft_vocab_size:
        s["draft_vocab_ids"] = (c.draft_vocab_size,)
    return s


def _unexpected_hint(names: list, c: DSparkConfig) -> str:
    """What would make the config describe the unexpected tensors ``names``."""
    hints = []
    if any(n.endswith("_proj.bias") and ".self_attn." in n for n in names) and not c.attention_bias:
        hints.append("q/k/v/o biases need attention_bias: true")
    if any(n.endswith("self_attn.v_proj.weight") for n in names) and c.attention_k_eq_v:
        hints.append("a v_proj means attention_k_eq_v: false (with it true, keys double as values)")
    gemma_only = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "layer_scalar")
    if any(g in n for n in names for g in gemma_only) and not c.gemma:
        hints.append(f"{'/'.join(gemma_only)} belong to DeepSpec's Gemma-4 layer: its config says architectures "
                     f"[{GEMMA4!r}] with model_type gemma4_text")
    if any(".mlp." in n and n.endswith(".bias") for n in names):
        hints.append("MLP biases are not implemented (DeepSpec's DSpark MLPs have none)")
    if not hints:
        hints.append("no layer this loader implements has them; supporting them needs dspark_export/dspark_model.py "
                     "to implement the module they belong to")
    return "; ".join(hints)


def save_checkpoint(model: DSparkDrafter, out_dir: Path, *, dtype=torch.float16, include_frozen: bool = False) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the DeepSpec layout; returns the folder.

    ``include_frozen=False`` omits the frozen copies of the target's embedding and LM head (recorded as
    ``frozen_from_target``; loading then needs the target). Floating tensors are stored as ``dtype``.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    c = model.config
    c.frozen_from_target = not include_frozen
    names = expected_shapes(c, include_frozen)
    state = model.state_dict()
    tensors = {}
    for n in names:
        t = state[n].detach().cpu().contiguous()
        tensors[n] = t.to(dtype) if t.is_floating_point() else t
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2) + "\n")
    return out_dir


def load_config(path: Path) -> DSparkConfig:
    """Read a draft ``config.json`` (a folder or the file itself).

    Raises:
        DraftConfigError: missing file, bad JSON, a missing/malformed DSpark field, or a field or value the
            drafter does not implement.
    """
    path = Path(path)
    f = path / "config.json" if path.is_dir() else path
    if not f.is_file():
        raise DraftConfigError(f"no DSpark draft config at {f}: pass a DeepSpec checkpoint folder holding "
                               "config.json and model.safetensors")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise DraftConfigError(f"{f}: not valid JSON ({e})") from None
    return DSparkConfig.from_dict(d, source=str(f))


def load_checkpoint(path: Path, *, target_embed=None, target_lm_head=None, dtype=torch.float32) -> DSparkDrafter:
    """Load a DeepSpec-layout drafter (``config.json`` + ``*.safetensors``), strictly: every checkpoint tensor
    is consumed and every model tensor filled; floating tensors are cast to ``dtype`` (the model's parameters
    and buffers are ``dtype``; RoPE frequencies stay float32, as transformers computes them).

    Args:
        target_embed, target_lm_head: the target's embedding / LM head weights [V, d]; required when the
            checkpoint omits its frozen copies (``frozen_from_target``), ignored otherwise.
    Raises:
        DraftConfigError: a missing, unexpected or mis-shaped tensor, a bad or unsupported config, or missing
            target weights.
    """
    from safetensors.torch import load_file

    path = Path(path)
    c = load_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftConfigError(f"{path}: no *.safetensors weights next to config.json")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    frozen = [n for n in ("embed_tokens.weight", "lm_head.weight") if n in tensors]
    if len(frozen) == 1:
        other = ({"embed_tokens.weight", "lm_head.weight"} - set(frozen)).pop()
        raise DraftConfigError(f"{path}: the checkpoint holds {frozen[0]} but not {other}; DeepSpec checkpoints hold "
                               "both frozen copies, ours (frozen_from_target) neither")
    has_frozen = len(frozen) == 2
    want = expected_shapes(c, include_frozen=has_frozen)
    unexpected = sorted(n for n in tensors if n not in want)
    if unexpected:
        raise DraftConfigError(f"{path}: checkpoint tensor(s) {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''} "
                               f"are not part of the {c.layer} drafter its config.json describes, and loading would "
                               f"drop them: {_unexpected_hint(unexpected, c)}")
    missing = [n for n in want if n not in tensors]
    if missing:
        raise DraftConfigError(f"{path}: checkpoint lacks tensor(s) {missing[:6]}{' ...' if len(missing) > 6 else ''} "
                               f"required by its config.json")
    for n, shape in want.items():
        if tuple(tensors[n].shape) != tuple(shape):
            raise DraftConfigError(f"{path}: tensor {n!r} has shape {tuple(tensors[n].shape)}, the config implies "
                                   f"{tuple(shape)}")
    sd = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in tensors.items()}
    if not has_frozen:
        if target_embed is None or target_lm_head is None:
            raise DraftConfigError(f"{path}: the checkpoint omits the frozen embedding/LM head "
                                   "(frozen_from_target); pass the target's weights")
        sd["embed_tokens.weight"] = target_embed.to(dtype)
        lm = target_lm_head.to(dtype)
        sd["lm_head.weight"] = lm if "draft_vocab_ids" not in sd else lm[sd["draft_vocab_ids"]]
        for n in ("embed_tokens.weight", "lm_head.weight"):
            want_shape = expected_shapes(c)[n]
            if tuple(sd[n].shape) != want_shape:
                raise DraftConfigError(f"{path}: the target's {n} has shape {tuple(sd[n].shape)}, the drafter's "
                                       f"config implies {want_shape}")
    with torch.device("meta"):  # no throw-away random init: the state dict's tensors become the parameters
        model = DSparkDrafter(c)
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise DraftConfigError(f"{path}: the checkpoint does not fill the drafter its config describes: {e}") from None
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise DraftConfigError(f"{path}: drafter tensor(s) {left[:6]} were not filled by the checkpoint")
    model.config.frozen_from_target = not has_frozen
    return model


def qwen2_draft_config(target_config: dict, *, mask_token_id: int, num_layers: int = 1,
                       intermediate_size: int | None = None, block_size: int = 7, target_layer_ids=(1, 13, 25),
                       markov_rank: int = 64, markov_head_type: str = "vanilla", draft_vocab_size: int | None = None,
                       confidence_head_with_markov: bool = True) -> DSparkConfig:
    """A DSpark config for a Qwen2/Qwen2.5/Llama/Mistral-family target: hidden size, heads, activation and RoPE
    from the target, DeepSpec's Qwen3 layer otherwise (q/k norm, no attention bias, full attention, untied head)."""
    d = dict(target_config)
    d.update(num_target_layers=int(target_config["num_hidden_layers"]), num_hidden_layers=num_layers,
             block_size=block_size, target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id),
             markov_rank=markov_rank, markov_head_type=markov_head_type, enable_confidence_head=True,
             confidence_head_with_markov=confidence_head_with_markov and markov_rank > 0, num_anchors=512)
    if intermediate_size:
        d["intermediate_size"] = intermediate_size
    if draft_vocab_size:
        d["draft_vocab_size"] = draft_vocab_size
    d.update(architectures=[QWEN3], attention_bias=False, tie_word_embeddings=False,
             layer_types=["full_attention"] * num_layers)
    d.setdefault("hidden_act", "silu")
    for k in ("use_sliding_window", "sliding_window", "max_window_layers", "auto_map"):
        d.pop(k, None)  # the target's attention layout; every draft layer attends to the whole context
    return DSparkConfig.from_dict(d, source="target config")
