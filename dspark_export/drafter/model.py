"""The DSpark drafter in torch (:class:`DSparkDraftModel`), for training and export; its configuration is
:mod:`dspark_export.drafter.config`, its checkpoints :mod:`dspark_export.drafter.checkpoint`.

Sources: DSpark paper §3 and DeepSpec ``deepspec/modeling/dspark/{qwen3,gemma4}/modeling.py`` (docs/design.md §1,
docs/drafter.md). The target's features at ``target_layer_ids`` (-1 = embedding output) are projected (``fc``,
``hidden_norm``) and injected as extra keys/values into every draft layer; a block is the anchor followed by γ−1
``mask_token_id`` tokens, attending to the context before the anchor and bidirectionally within the block; block
position k drafts the token at anchor + k + 1. Parameter names are DeepSpec's. Two extensions of ours: a reduced
draft vocabulary (``draft_vocab_ids``: draft token i is target id ``draft_vocab_ids[i]``) and the MoE FFN
(:class:`~dspark_export.drafter.ffn.DraftMoE`). DeepSpec's DFlash drafters are this model without its Markov and
confidence heads (``markov_rank`` 0, ``enable_confidence_head`` false).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_export.drafter.config import QWEN3, DSparkConfig
from dspark_export.drafter.config_fields import rotary_table
from dspark_export.drafter.ffn import DraftMLP, DraftMoE


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
    """Attention of a block over the injected context keys/values and its own positions.

    Both families: q/k RMSNorm per head, RoPE on queries and keys (context keys at their own positions), grouped
    KV heads. Qwen3: q/k/v/o biases iff ``attention_bias``, scores scaled by head_dim^-½. Gemma-4: head size
    ``global_head_dim``, keys double as values when ``attention_k_eq_v`` (no ``v_proj``), a weightless v RMSNorm,
    scores unscaled.
    """

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
    """One draft layer. Qwen3: pre-norm residual blocks. Gemma-4: sandwich norms,
    x + post_attention_layernorm(attn(input_layernorm(x))), then x + post_feedforward_layernorm(mlp(
    pre_feedforward_layernorm(x))), the output times ``layer_scalar``."""

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
    """The sequential Markov head: logits_k = U_k + W2·f(W1[x_{k−1}], h_k) with x_{−1} = the anchor. W1 [V_in, r]
    embeds the previous token (V_in = V_d + 1 with a reduced vocabulary: the last row stands for every token outside
    it), W2 [V_out, r] projects. ``vanilla``: f = identity; ``gated``: σ(W_g[h_k; W1[x]])⊙W1[x]; ``rnn``: a GRU-like
    state over the block. ``markov_rank`` 0 builds no head (DFlash; :class:`DSparkDraftModel` then has
    ``markov_head`` None, as it has ``confidence_head`` None when ``enable_confidence_head`` is false)."""

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
    """Pre-sigmoid confidence c_k = wᵀ[h_k; W1[x_{k−1}]] + b (wᵀh_k + b without the Markov features), trained to the
    soft acceptance 1 − ½‖p_d − p_t‖₁."""

    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1)

    def forward(self, x):
        return self.proj(x).squeeze(-1)


class DSparkDraftModel(nn.Module):
    """The DSpark drafter's torch model, for training and export (see the module docstring for the architecture and
    sources); at run time its compiled graph is driven by :class:`dspark_runtime.drafting.dspark.DSparkDrafter`.
    Gemma-4 scales the embeddings by sqrt(hidden_size) and soft-caps the base logits (:meth:`embed`,
    :meth:`base_logits`)."""

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


def qwen2_draft_config(target_config: dict, *, mask_token_id: int, num_layers: int = 1,
                       intermediate_size: int | None = None, block_size: int = 7, target_layer_ids=(1, 13, 25),
                       markov_rank: int = 64, markov_head_type: str = "vanilla", draft_vocab_size: int | None = None,
                       confidence_head_with_markov: bool = True, confidence_head: bool = True, moe_experts: int = 0,
                       moe_top_k: int = 2, moe_intermediate_size: int | None = None) -> DSparkConfig:
    """A DSpark config for a Qwen2/Qwen2.5/Llama/Mistral-family target: hidden size, heads, activation and RoPE
    from the target, DeepSpec's Qwen3 layer otherwise (q/k norm, no attention bias, full attention, untied head).

    ``moe_experts`` > 0 makes every draft layer's FFN a :class:`DraftMoE` of that many experts mixing
    ``moe_top_k`` per token (our extension; e.g. 8 and 2); each expert's width ``moe_intermediate_size``
    defaults to the dense width // ``moe_top_k``, so the k active experts together are as wide as the dense MLP
    (the same active parameters per token, E/k times the FFN parameters).

    ``markov_rank`` 0 builds no Markov head (``markov_head_type`` is then not written) and ``confidence_head``
    False no confidence head (nor ``confidence_head_with_markov``): both together are DeepSpec's DFlash layout."""
    d = dict(target_config)
    d.update(num_target_layers=int(target_config["num_hidden_layers"]), num_hidden_layers=num_layers,
             block_size=block_size, target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id),
             markov_rank=markov_rank, enable_confidence_head=bool(confidence_head), num_anchors=512)
    if markov_rank > 0:
        d["markov_head_type"] = markov_head_type
    if confidence_head:
        d["confidence_head_with_markov"] = confidence_head_with_markov and markov_rank > 0
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
