"""EAGLE-3 drafters (DeepSpec's ``Qwen3Eagle3Model``; SpecForge's, :mod:`dspark_export.drafter.eagle3_specforge`):
``config.json`` parsed strictly (:class:`Eagle3Config`), the torch model (:class:`Eagle3DraftModel`) and
:func:`load_eagle3_checkpoint`; the graph is :mod:`dspark_export.drafter.eagle3_graph`, the runtime drafter
:mod:`dspark_runtime.drafting.eagle3`.

Sources: DeepSpec ``deepspec/modeling/eagle3/qwen3/modeling.py`` and its evaluator
``deepspec/eval/eagle3/evaluator.py``; parity: ``tests/export/drafter/test_eagle3.py``. The drafter fuses the
target's hidden states at ``target_layer_ids`` (concatenated in that order, ``fc``) into one state per position;
its single decoder layer takes RMSNorm(embedding of the *next* token) ‖ RMSNorm(that state) (width 2·d) into
q/k/v, adds attention and MLP to the state (residual), and ``lm_head(norm(·))`` gives full-vocabulary logits.
Draft step k feeds the layer's own output state back in place of the target's, with the token drafted at step
k − 1, one position further, on the drafter's own KV cache. As in DeepSpec's decoding path: the state at position
i goes with token i + 1 at RoPE position i; a round drafts ``ttt_length`` tokens greedily from the last state; the
verified positions' target states then extend the cache (the round's draft entries are dropped first).

Layouts: DeepSpec's (tensors named as its ``Qwen3Eagle3Model``, q/k norms, full-vocabulary ``lm_head``); SpecForge's
(no q/k norms, ``lm_head`` over draft tokens, target ids ``draft_vocab_ids``). Other fields or tensors are refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn


from dspark_export.drafter import eagle3_specforge as specforge
from dspark_export.drafter.checkpoint import assign_state, read_tensors, write_weights
from dspark_export.drafter.config_fields import (DraftConfigError, activation, bool_field, int_field, read_config_json,
                                                 rope_parameters, rotary_table)
from dspark_export.drafter.families import CONDITIONAL_FIELDS, IGNORED_FIELDS, QWEN3
from dspark_export.drafter.ffn import DraftMLP
from dspark_export.drafter.model import RMSNorm, rope

ARCHITECTURE = "Qwen3Eagle3Model"
REFUSED_ARCHITECTURES = {
    "Gemma4Eagle3Model": "DeepSpec's Gemma-4 EAGLE-3 drafter (its own layer: Gemma-4 norms, attention and "
                         "embedding scale) is not implemented yet; only Qwen3Eagle3Model loads",
    **specforge.REFUSED_ARCHITECTURES,
}
MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")
# config.json fields the drafter reads (DeepSpec's Qwen3 EAGLE-3 config is the target's config plus these).
USED_FIELDS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "draft_num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
               "rms_norm_eps", "attention_bias", "hidden_act", "rope_parameters", "rope_theta", "rope_scaling",
               "original_max_position_embeddings", "max_position_embeddings", "layer_types", "tie_word_embeddings",
               "target_layer_ids", "num_target_layers", "ttt_length")
REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "rms_norm_eps", "target_layer_ids", "ttt_length")
# accepted only with the values implemented: the same as the DSpark Qwen3 layer's (mlp_bias false, no sliding window)
EAGLE3_CONDITIONAL = dict(CONDITIONAL_FIELDS[QWEN3])
EAGLE3_IGNORED = dict({k: v for k, v in IGNORED_FIELDS.items() if k != "num_anchors"},
                      step_loss_decay="training only (the weight of each TTT step's loss)",
                      target_model_name_or_path="provenance (the target the drafter was trained for)")
# fields of other EAGLE-3 layouts, refused with what they mean
REFUSED_FIELDS = {
    "draft_vocab_size": "a reduced draft vocabulary (d2t/t2d tensors) is the SpecForge / vLLM layout's, which "
                        f"loads as [{specforge.ARCHITECTURE!r}]; DeepSpec's layout has a full-vocabulary lm_head",
}
VOCAB_MAP_TENSORS = ("d2t", "t2d")


@dataclass
class Eagle3Config:
    """An EAGLE-3 drafter's configuration (DeepSpec's or SpecForge's ``architecture``; ``source``: its config.json).
    ``qk_norm``: q/k RMSNorm per head; ``draft_vocab_size`` / ``target_hidden_size``: None = vocab / hidden size."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    target_layer_ids: list
    ttt_length: int  # draft steps per round in DeepSpec's evaluator (its max_proposal_tokens)
    num_hidden_layers: int = 1
    num_target_layers: int | None = None
    attention_bias: bool = False
    hidden_act: str = "silu"
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int | None = None
    source: dict = field(default_factory=dict)
    rope_inv_freq: torch.Tensor | None = field(default=None, repr=False, compare=False)
    rope_attention_scaling: float = 1.0
    layer: str = QWEN3  # the rotary table is Qwen3's (rotary_table reads it)
    qk_norm: bool = True
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    architecture: str = ARCHITECTURE

    @property
    def feature_size(self) -> int:
        """Width of the fused target features: len(target_layer_ids) · (target_hidden_size or hidden_size)."""
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json", target_num_layers: int | None = None) -> "Eagle3Config":
        """Validate an EAGLE-3 draft config dict: DeepSpec's, or SpecForge's (:func:`~dspark_export.drafter.
        eagle3_specforge.specforge_fields`; ``target_num_layers`` gives its default layers).

        Raises:
            DraftConfigError: a missing or malformed field, or a field, value or architecture this loader does not
                implement (the message names it).
        """
        if not isinstance(d, dict):
            raise DraftConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("architectures") == [specforge.ARCHITECTURE]:
            return cls(**specforge.specforge_fields(d, source, target_num_layers), source=dict(d))._with_rope(source)
        arch = d.get("architectures")
        if arch is not None:
            if isinstance(arch, list) and len(arch) == 1 and arch[0] in REFUSED_ARCHITECTURES:
                raise DraftConfigError(f"{source}: architectures {arch!r}: {REFUSED_ARCHITECTURES[arch[0]]}")
            if arch != [ARCHITECTURE]:
                raise DraftConfigError(f"{source}: architectures {arch!r} is not DeepSpec's EAGLE-3 drafter "
                                       f"[{ARCHITECTURE!r}] nor SpecForge / vLLM's [{specforge.ARCHITECTURE!r}], the "
                                       "ones this loader implements")
        mt = d.get("model_type")
        if mt is not None and mt not in MODEL_TYPES:
            raise DraftConfigError(f"{source}: model_type {mt!r} is not implemented by the {ARCHITECTURE} layer "
                                   f"(it accepts {list(MODEL_TYPES)})")
        for k, why in REFUSED_FIELDS.items():
            if k in d:
                raise DraftConfigError(f"{source}: config field {k!r} = {d[k]!r}: {why}")
        known = set(USED_FIELDS) | set(EAGLE3_CONDITIONAL) | set(EAGLE3_IGNORED)
        unknown = [k for k in d if k not in known]
        if unknown:
            raise DraftConfigError(
                f"{source}: config field {unknown[0]!r} = {d[unknown[0]]!r}"
                f"{f' (and {unknown[1:]})' if len(unknown) > 1 else ''} is not implemented by this loader's "
                f"{ARCHITECTURE} layer; loading would ignore it and draft with a different function")
        missing = [k for k in REQUIRED_FIELDS if k not in d]
        if missing:
            raise DraftConfigError(f"{source}: missing field(s) {missing}; a DeepSpec EAGLE-3 draft config is the "
                                   "target's config plus target_layer_ids, ttt_length and draft_num_hidden_layers")

        _int, _bool = partial(int_field, d, source), partial(bool_field, d, source)

        n_layers = _int("num_hidden_layers", 1)
        dn = d.get("draft_num_hidden_layers")
        if dn is not None and dn != n_layers:
            raise DraftConfigError(f"{source}: draft_num_hidden_layers {dn!r} and num_hidden_layers {n_layers} "
                                   "disagree (DeepSpec writes both as the draft's layer count)")
        if n_layers != 1:
            raise DraftConfigError(
                f"{source}: num_hidden_layers {n_layers} is not implemented: one draft layer only, as DeepSpec's "
                "EAGLE-3 evaluator requires (it extends the draft cache with several tokens without a causal mask, "
                "which only a single layer's cached keys/values are independent of)")
        ntl = d.get("num_target_layers")
        if ntl is not None:
            ntl = _int("num_target_layers", 1)
        ids = d["target_layer_ids"]
        if (not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
                or any(b <= a for a, b in zip(ids, ids[1:])) or min(ids) < 0):
            raise DraftConfigError(f"{source}: 'target_layer_ids' must be a non-empty strictly increasing list of "
                                   f"target decoder layer indices >= 0, got {ids!r}")
        if ntl is not None and max(ids) >= ntl - 1:
            raise DraftConfigError(f"{source}: target_layer_ids {ids} must lie below the target's final layer "
                                   f"{ntl - 1} (num_target_layers {ntl}): DeepSpec refuses the final layer, whose "
                                   "output_hidden_states entry is the normed final state, not the layer output")
        if _bool("tie_word_embeddings", False):
            raise DraftConfigError(f"{source}: tie_word_embeddings true is not implemented: DeepSpec's EAGLE-3 "
                                   "drafter holds an untied lm_head (it writes tie_word_embeddings false)")
        if _bool("mlp_bias", False):
            raise DraftConfigError(f"{source}: mlp_bias true is not implemented: DeepSpec's Qwen3 MLP has no biases")
        lt = d.get("layer_types")
        if lt is not None and (not isinstance(lt, list) or len(lt) < n_layers
                               or any(t != "full_attention" for t in lt[:n_layers])):
            raise DraftConfigError(f"{source}: layer_types {lt!r} is not implemented: the draft layer attends to its "
                                   "whole cache (DeepSpec writes ['full_attention'])")
        if lt is None and _bool("use_sliding_window", False):
            raise DraftConfigError(f"{source}: use_sliding_window true (without layer_types) is not implemented")
        heads, kv, hidden = _int("num_attention_heads", 1), _int("num_key_value_heads", 1), _int("hidden_size", 1)
        head_dim = d.get("head_dim") or hidden // heads
        if heads % kv:
            raise DraftConfigError(f"{source}: num_attention_heads {heads} is not a multiple of the {kv} KV heads")
        if int(head_dim) % 2:
            raise DraftConfigError(f"{source}: head size {head_dim} must be even (RoPE)")
        mpe = d.get("max_position_embeddings")
        c = cls(hidden_size=hidden, intermediate_size=_int("intermediate_size", 1), num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=int(head_dim), vocab_size=_int("vocab_size", 1),
                rms_norm_eps=float(d["rms_norm_eps"]), target_layer_ids=list(ids), ttt_length=_int("ttt_length", 1),
                num_hidden_layers=n_layers, num_target_layers=ntl, attention_bias=_bool("attention_bias", False),
                hidden_act=activation(d.get("hidden_act", "silu"), "hidden_act", source),
                rope_parameters=rope_parameters(d, QWEN3, source),
                max_position_embeddings=None if mpe is None else _int("max_position_embeddings", 1),
                source=json.loads(json.dumps(d)))
        return c._with_rope(source)

    def _with_rope(self, source: str) -> "Eagle3Config":  # the rotary table, transformers' (config.rotary_table)
        try:
            self.rope_inv_freq, self.rope_attention_scaling = rotary_table(self)
        except DraftConfigError as e:
            raise DraftConfigError(f"{source}: {e}") from None
        return self


def load_eagle3_config(path: Path, target_num_layers: int | None = None) -> Eagle3Config:
    """Read an EAGLE-3 draft ``config.json`` (a folder or the file); ``target_num_layers``: see ``from_dict``.

    Raises:
        DraftConfigError: a missing file, bad JSON, or a field :meth:`Eagle3Config.from_dict` refuses.
    """
    d, source = read_config_json(path, "EAGLE-3")
    return Eagle3Config.from_dict(d, source=source, target_num_layers=target_num_layers)


class Eagle3Cache:
    """The drafter's KV cache: per layer, keys and values [b, kv heads, length, head_dim] (RoPE applied)."""

    def __init__(self):
        self.layers: list = []

    def __len__(self) -> int:
        return 0 if not self.layers else int(self.layers[0][0].shape[2])

    def append(self, i: int, k, v):
        """Append keys/values of layer ``i``; returns that layer's whole keys/values."""
        if i == len(self.layers):
            self.layers.append((k, v))
        else:
            k0, v0 = self.layers[i]
            self.layers[i] = (torch.cat([k0, k], 2), torch.cat([v0, v], 2))
        return self.layers[i]

    def crop(self, length: int):
        """Keep the first ``length`` positions (DeepSpec's ``DynamicCache.crop``)."""
        self.layers = [(k[:, :, :length], v[:, :, :length]) for k, v in self.layers]


class Eagle3Attention(nn.Module):
    """Grouped-query attention of 2·d inputs: q/k RMSNorm per head (``qk_norm``), RoPE, scores scaled by
    head_dim^-½, causal over the cache and the new positions."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        h, kv, hd, b = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attention_bias
        self.q_proj = nn.Linear(2 * c.hidden_size, h * hd, bias=b)
        self.k_proj = nn.Linear(2 * c.hidden_size, kv * hd, bias=b)
        self.v_proj = nn.Linear(2 * c.hidden_size, kv * hd, bias=b)
        self.o_proj = nn.Linear(h * hd, c.hidden_size, bias=b)
        if c.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, c.rms_norm_eps), RMSNorm(hd, c.rms_norm_eps)

    def project(self, x, positions):
        """x [b, n, 2d] at positions [b, n] -> (q [b, h, n, hd], k, v [b, kv, n, hd]): q/k normed per head, RoPE."""
        b, n, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, n, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return (rope(q, positions, c.rope_inv_freq, c.rope_attention_scaling),
                rope(k, positions, c.rope_inv_freq, c.rope_attention_scaling), v)

    def attend(self, q, k, v, mask):
        """q [b, h, n, hd] over all keys/values k, v [b, kv, L, hd] where ``mask`` (bool, broadcast to [b, 1, n, L];
        True = may attend) allows -> [b, n, d]."""
        b, _, n, _ = q.shape
        c = self.c
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * c.head_dim ** -0.5
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x, positions, cache: Eagle3Cache | None, layer_idx: int):
        """x [b, n, 2d] at positions [b, n] -> [b, n, d]; appends the keys/values to ``cache``."""
        n = x.shape[1]
        q, k, v = self.project(x, positions)
        past = 0 if cache is None else len(cache)
        if cache is not None:
            k, v = cache.append(layer_idx, k, v)
        mask = torch.arange(k.shape[2], device=x.device)[None, :] <= past + torch.arange(n, device=x.device)[:, None]
        return self.attend(q, k, v, mask)


class Eagle3Layer(nn.Module):
    """DeepSpec's EAGLE-3 decoder layer: attention over input_layernorm(embeds) ‖ hidden_norm(state), then the MLP,
    each added to the state."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(c)
        self.mlp = DraftMLP(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, embeds, state, positions, cache, layer_idx: int):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1)
        state = state + self.self_attn(x, positions, cache, layer_idx)
        return state + self.mlp(self.post_attention_layernorm(state))

    def step(self, embeds, state, positions, past_k, past_v, mask):
        """The layer on explicit keys/values (the ONNX graph's form): ``past_k``/``past_v`` [b, kv, P, hd], ``mask``
        bool [b, 1, n, P + n]. Returns (state [b, n, d], keys, values [b, kv, P + n, hd])."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1)
        q, k, v = self.self_attn.project(x, positions)
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        state = state + self.self_attn.attend(q, k, v, mask)
        return state + self.mlp(self.post_attention_layernorm(state)), k, v


class Eagle3DraftModel(nn.Module):
    """The EAGLE-3 drafter in torch; parameter names are DeepSpec's ``Qwen3Eagle3Model``'s. ``draft_vocab_ids``
    (int64 [V_d], set by the loader; None = the full vocabulary): the target id of each lm_head row."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        d = c.hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, d)
        self.fc = nn.Linear(c.feature_size, d, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.lm_head = nn.Linear(d, c.draft_vocab_size or c.vocab_size, bias=False)
        self.draft_vocab_ids = None

    def forward(self, state, input_ids, positions, cache: Eagle3Cache | None = None):
        """Draft states [b, n, d] of ``n`` positions: ``state`` [b, n, d] (a previous draft state, or fused target
        features already through :meth:`fuse`), ``input_ids`` [b, n] (the token *after* each position),
        ``positions`` [b, n] (RoPE). Causal over ``cache`` (extended in place) and the new positions."""
        embeds = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            state = layer(embeds, state, positions, cache, i)
        return state

    def fuse(self, features):
        """The target's hidden states at ``target_layer_ids``, concatenated in that order [b, n, m·d] -> [b, n, d]."""
        if features.shape[-1] != self.config.feature_size:
            raise ValueError(f"target features have width {features.shape[-1]}, the drafter fuses "
                             f"{len(self.config.target_layer_ids)} layers of {self.config.hidden_size}")
        return self.fc(features)

    def extend(self, features, input_ids, positions, cache: Eagle3Cache):
        """Add target positions to the cache (DeepSpec's ``extend_draft_cache``): ``features`` [b, n, m·d] of
        positions ``positions`` [b, n], ``input_ids`` [b, n] the tokens that follow them; returns the last draft
        state [b, 1, d], the start of the next round."""
        return self(self.fuse(features), input_ids, positions, cache)[:, -1:]

    def logits(self, state):
        """lm_head(norm(state)): logits over the draft vocabulary (``draft_vocab_ids``) or the full one."""
        return self.lm_head(self.norm(state))

    def init_from_target(self, embed, lm_head, freeze: bool = True):
        """Copy the target's embedding and LM head [V, d] (its ``draft_vocab_ids`` rows; frozen, as DeepSpec does)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.lm_head.weight.copy_(lm_head if self.draft_vocab_ids is None else lm_head[self.draft_vocab_ids])
        self.embed_tokens.requires_grad_(not freeze)
        self.lm_head.requires_grad_(not freeze)

    @torch.no_grad()
    def greedy_draft(self, state, start: int, cache: Eagle3Cache, steps: int | None = None):
        """One round of ``steps`` (default ``ttt_length``) greedy draft tokens from ``state`` [b, 1, d] (the last
        :meth:`extend` output); the first draft's step runs at position ``start`` (the position of the round's
        first verified token). The cache is left as before the round.

        Returns (states [b, k, d] the logits came from, logits [b, k, V_d], target token ids [b, k]).
        """
        steps = self.config.ttt_length if steps is None else steps
        before = len(cache)
        states, logits, tokens = [], [], []
        b = state.shape[0]
        for k in range(steps):
            lg = self.logits(state)
            tok = torch.argmax(lg, dim=-1)
            tok = tok if self.draft_vocab_ids is None else self.draft_vocab_ids.to(tok.device)[tok]
            states.append(state)
            logits.append(lg)
            tokens.append(tok)
            if k + 1 < steps:
                pos = torch.full((b, 1), start + k, dtype=torch.long, device=state.device)
                state = self(state, tok, pos, cache)
        cache.crop(before)
        return torch.cat(states, 1), torch.cat(logits, 1), torch.cat(tokens, 1)


def expected_eagle3_shapes(c: Eagle3Config) -> dict:
    """Every tensor name of an EAGLE-3 checkpoint for ``c`` (our names: DeepSpec's) -> its shape."""
    d, hd, h, kv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    s = {"embed_tokens.weight": (c.vocab_size, d), "fc.weight": (d, c.feature_size), "norm.weight": (d,),
         "lm_head.weight": (c.draft_vocab_size or c.vocab_size, d)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        for name, shape in (("q_proj", (h * hd, 2 * d)), ("k_proj", (kv * hd, 2 * d)), ("v_proj", (kv * hd, 2 * d)),
                            ("o_proj", (d, h * hd))):
            s[p + f"self_attn.{name}.weight"] = shape
            if c.attention_bias:
                s[p + f"self_attn.{name}.bias"] = (shape[0],)
        if c.qk_norm:
            s[p + "self_attn.q_norm.weight"], s[p + "self_attn.k_norm.weight"] = (hd,), (hd,)
        s[p + "mlp.gate_proj.weight"] = (c.intermediate_size, d)
        s[p + "mlp.up_proj.weight"] = (c.intermediate_size, d)
        s[p + "mlp.down_proj.weight"] = (d, c.intermediate_size)
        for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            s[p + f"{n}.weight"] = (d,)
    return s


def load_eagle3_checkpoint(path: Path, *, dtype=torch.float32, target_num_layers: int | None = None,
                           target_embed=None) -> Eagle3DraftModel:
    """Load an EAGLE-3 drafter (``config.json`` + ``*.safetensors``, DeepSpec's or SpecForge's layout) strictly: every
    tensor consumed, every model tensor filled with the shape the config implies; floating tensors cast to ``dtype``
    (RoPE frequencies stay float32). SpecForge's: ``target_num_layers`` as :meth:`Eagle3Config.from_dict`,
    ``target_embed`` [V, d] the target's embedding where the checkpoint leaves it out.

    Raises:
        DraftConfigError: d2t/t2d in DeepSpec's layout, an inconsistent vocabulary map, an unexpected, missing or
            mis-shaped tensor, or a config field :class:`Eagle3Config` refuses.
    """
    path = Path(path)
    c = load_eagle3_config(path, target_num_layers)
    tensors, vocab_ids = read_tensors(path), None
    if c.architecture == specforge.ARCHITECTURE:
        tensors, vocab_ids, _ = specforge.specforge_tensors(tensors, c, path, target_embed)
    elif vmap := [n for n in VOCAB_MAP_TENSORS if n in tensors]:
        raise DraftConfigError(f"{path}: d2t/t2d vocabulary map present ({vmap}) in a {ARCHITECTURE} checkpoint: "
                               f"{specforge.NOT_IN_DEEPSPEC}")
    want = expected_eagle3_shapes(c)
    unexpected = sorted(n for n in tensors if n not in want)
    if unexpected:
        raise DraftConfigError(f"{path}: checkpoint tensor(s) {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''} "
                               f"are not part of the {ARCHITECTURE} drafter its config.json describes, and loading "
                               "would drop them")
    missing = [n for n in want if n not in tensors]
    if missing:
        raise DraftConfigError(f"{path}: checkpoint lacks tensor(s) {missing[:6]}{' ...' if len(missing) > 6 else ''} "
                               "required by its config.json")
    for n, shape in want.items():
        if tuple(tensors[n].shape) != tuple(shape):
            raise DraftConfigError(f"{path}: tensor {n!r} has shape {tuple(tensors[n].shape)}, the config implies "
                                   f"{tuple(shape)}")
    sd = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in tensors.items()}
    model = assign_state(lambda: Eagle3DraftModel(c), sd, path)
    model.draft_vocab_ids = vocab_ids
    return model


def eagle3_config_for(target_config: dict, target_layer_ids, ttt_length: int = 7,
                      intermediate_size: int | None = None) -> Eagle3Config:
    """A DeepSpec-layout EAGLE-3 config for a Qwen2/Qwen3/Llama target's ``config.json`` dict: one draft layer of the
    target's width and heads (``intermediate_size`` defaults to the target's), fusing ``target_layer_ids``; the
    fields DeepSpec's ``build_draft_config`` writes. Raises DraftConfigError as :meth:`Eagle3Config.from_dict`."""
    t = target_config
    cfg = {"architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_size": t["hidden_size"],
           "intermediate_size": intermediate_size or t["intermediate_size"], "num_hidden_layers": 1,
           "draft_num_hidden_layers": 1, "num_attention_heads": t["num_attention_heads"],
           "num_key_value_heads": t.get("num_key_value_heads", t["num_attention_heads"]),
           "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
           "vocab_size": t["vocab_size"], "rms_norm_eps": t["rms_norm_eps"], "hidden_act": t.get("hidden_act", "silu"),
           "attention_bias": False,
           "rope_parameters": t.get("rope_parameters") or {"rope_type": "default",
                                                           "rope_theta": float(t.get("rope_theta", 10000.0))},
           "max_position_embeddings": t.get("max_position_embeddings"), "tie_word_embeddings": False,
           "target_layer_ids": [int(x) for x in target_layer_ids], "num_target_layers": t["num_hidden_layers"],
           "ttt_length": int(ttt_length), "step_loss_decay": 0.8}
    return Eagle3Config.from_dict(cfg, source="EAGLE-3 config for the target")


def save_eagle3_checkpoint(model: Eagle3DraftModel, out_dir: Path, *, dtype=torch.float32,
                           shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in DeepSpec's layout (every tensor, floating ones as ``dtype``;
    ``shard_bytes``: in shards, :func:`~dspark_export.drafter.checkpoint.write_weights`), loadable by
    :func:`load_eagle3_checkpoint`; returns the folder. Raises DraftConfigError for another layout."""
    if model.config.architecture != ARCHITECTURE:
        raise DraftConfigError(f"save_eagle3_checkpoint writes DeepSpec's layout, not {model.config.architecture}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    want = expected_eagle3_shapes(model.config)
    state = model.state_dict()
    tensors = {n: state[n].detach().cpu().to(dtype).contiguous() for n in want}
    write_weights(tensors, out_dir, shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(model.config.source, indent=2) + "\n")
    return out_dir
