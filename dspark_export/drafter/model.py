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

Configuration and strict loading of ``config.json``: :mod:`dspark_export.drafter.config`.

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

**MoE FFN** (our extension, :class:`DraftMoE`): with ``draft_moe_experts`` = E > 0 every draft layer's MLP is a
router ``layers.N.mlp.gate`` (d -> E) over E SwiGLU experts ``layers.N.mlp.experts.J.{gate,up,down}_proj`` of width
``draft_moe_intermediate_size``, mixing the ``draft_moe_top_k`` most probable per token (Mixtral routing); all E are
computed and weighted (0 outside the top-k), which exports as a fixed graph. ``DSparkDraftModel.moe_aux_loss()`` is
the Switch-Transformer load-balancing loss of the last forward.
"""
from __future__ import annotations
import json
from pathlib import Path

import torch
from torch import nn

from dspark_export.drafter.ffn import DraftMLP, DraftMoE
from dspark_export.drafter.config import (GEMMA4, QWEN3, WEIGHTS_NAME, DraftConfigError, DSparkConfig, load_config,
                                         rotary_table)


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


class DraftLayer(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.gemma = c.gemma
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMoE(c) if c.moe else DraftMLP(c)
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


class DSparkDraftModel(nn.Module):
    """The DSpark drafter's torch model, for training and export (see the module docstring for the architecture and
    sources); at run time its compiled graph is driven by :class:`dspark_runtime.drafting.dspark.DSparkDrafter`."""

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
                t2d[self.draft_vocab_ids.cpu()] = torch.arange(c.draft_vocab_size)
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

    def moe_aux_loss(self, token_mask=None) -> torch.Tensor:
        """The MoE load-balancing loss of the last forward (:meth:`DraftMoE.aux_loss`, Switch Transformer's
        E·Σ_i f_i·P_i) averaged over the draft layers, a float32 scalar; a 0 tensor for the dense MLP.

        Add it to the training loss times a small coefficient (0.01, Switch Transformer's α), after the
        forward (``block_hidden``) whose routing it balances. ``token_mask`` (bool [b, q] over the block
        tokens of that forward, e.g. the kept anchors' blocks) leaves padding tokens out; None = all tokens.
        """
        moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, DraftMoE)]
        if not moes:
            return torch.zeros((), dtype=torch.float32, device=self.norm.weight.device)
        return torch.stack([m.aux_loss(token_mask) for m in moes]).mean()

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
        if c.moe:  # our MoE FFN option (Mixtral-like names)
            w = c.draft_moe_intermediate_size
            s[p + "mlp.gate.weight"] = (c.draft_moe_experts, d)
            for j in range(c.draft_moe_experts):
                s[p + f"mlp.experts.{j}.gate_proj.weight"] = (w, d)
                s[p + f"mlp.experts.{j}.up_proj.weight"] = (w, d)
                s[p + f"mlp.experts.{j}.down_proj.weight"] = (d, w)
        else:
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
    if any(".mlp.experts." in n or n.endswith(".mlp.gate.weight") for n in names):
        if not c.moe:
            hints.append("mlp.gate / mlp.experts.N.* are the MoE FFN option: its config.json needs "
                         "draft_moe_experts, draft_moe_top_k and draft_moe_intermediate_size (our extension)")
        else:
            hints.append(f"the config gives draft_moe_experts {c.draft_moe_experts}; does the checkpoint hold more "
                         "experts?")
    if c.moe and any(n.split(".mlp.")[-1] in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
                     for n in names):
        hints.append("mlp.{gate,up,down}_proj are the dense MLP's: the checkpoint was saved dense, so remove "
                     "draft_moe_experts / draft_moe_top_k / draft_moe_intermediate_size from config.json")
    if not hints:
        hints.append("no layer this loader implements has them; supporting them needs dspark_export/drafter/model.py "
                     "to implement the module they belong to")
    return "; ".join(hints)


def save_checkpoint(model: DSparkDraftModel, out_dir: Path, *, dtype=torch.float16, include_frozen: bool = False) -> Path:
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


def load_checkpoint(path: Path, *, target_embed=None, target_lm_head=None, dtype=torch.float32) -> DSparkDraftModel:
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
        model = DSparkDraftModel(c)
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
                       confidence_head_with_markov: bool = True, moe_experts: int = 0, moe_top_k: int = 2,
                       moe_intermediate_size: int | None = None) -> DSparkConfig:
    """A DSpark config for a Qwen2/Qwen2.5/Llama/Mistral-family target: hidden size, heads, activation and RoPE
    from the target, DeepSpec's Qwen3 layer otherwise (q/k norm, no attention bias, full attention, untied head).

    ``moe_experts`` > 0 makes every draft layer's FFN a :class:`DraftMoE` of that many experts mixing
    ``moe_top_k`` per token (our extension; e.g. 8 and 2); each expert's width ``moe_intermediate_size``
    defaults to the dense width // ``moe_top_k``, so the k active experts together are as wide as the dense MLP
    (the same active parameters per token, E/k times the FFN parameters)."""
    d = dict(target_config)
    d.update(num_target_layers=int(target_config["num_hidden_layers"]), num_hidden_layers=num_layers,
             block_size=block_size, target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id),
             markov_rank=markov_rank, markov_head_type=markov_head_type, enable_confidence_head=True,
             confidence_head_with_markov=confidence_head_with_markov and markov_rank > 0, num_anchors=512)
    if intermediate_size:
        d["intermediate_size"] = intermediate_size
    if draft_vocab_size:
        d["draft_vocab_size"] = draft_vocab_size
    if moe_experts:
        d.update(draft_moe_experts=moe_experts, draft_moe_top_k=moe_top_k,
                 draft_moe_intermediate_size=moe_intermediate_size
                 or max(1, int(d["intermediate_size"]) // max(1, moe_top_k)))
    d.update(architectures=[QWEN3], attention_bias=False, tie_word_embeddings=False,
             layer_types=["full_attention"] * num_layers)
    d.setdefault("hidden_act", "silu")
    for k in ("use_sliding_window", "sliding_window", "max_window_layers", "auto_map"):
        d.pop(k, None)  # the target's attention layout; every draft layer attends to the whole context
    return DSparkConfig.from_dict(d, source="target config")
