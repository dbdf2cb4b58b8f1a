"""The DSpark drafter in torch: configuration, model, and DeepSpec-layout checkpoints.

Architecture (docs/design.md §1; DSpark paper §3; DeepSpec ``deepspec/modeling/dspark/qwen3/modeling.py``):

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

Layers follow DeepSpec's Qwen3 DSpark layer (q/k RMSNorm, SiLU MLP, no attention bias) whatever the
target family. Parameter names are DeepSpec's: ``fc``, ``hidden_norm``, ``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.self_attn.{q,k}_norm``, ``layers.N.mlp.{gate,up,down}_proj``, ``layers.N.{input,post_attention}_layernorm``,
``norm``, ``embed_tokens``, ``lm_head``, ``markov_head.markov_w1``/``markov_w2`` (+ ``gate_proj``/``joint_proj``),
``confidence_head.proj``.

**Reduced draft vocabulary** (our extension, recorded, exact): with ``draft_vocab_size`` = V_d set, the
drafter scores only the target ids ``draft_vocab_ids`` (int64 [V_d], stored in the checkpoint); draft
token i means target id draft_vocab_ids[i]. ``lm_head`` then holds those V_d rows of the target's head,
``markov_w2`` is [V_d, r] and ``markov_w1`` is [V_d + 1, r] where the last row embeds every previous token
outside the draft vocabulary. Frozen copies of the target's embedding and LM head may be omitted from the
checkpoint (``frozen_from_target``); they are then taken from the target at load time.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

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


class DraftConfigError(DSparkError):
    """A DSpark draft config.json or checkpoint is missing a field or tensor, or has a malformed one."""


def _rope_theta(d: dict) -> float:
    if "rope_theta" in d:
        return float(d["rope_theta"])
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    return 10000.0


@dataclass
class DSparkConfig:
    """A DSpark drafter's configuration; reads and writes DeepSpec's draft ``config.json``.

    DeepSpec configs are a copy of the whole target config plus the DSpark fields; the copied target
    fields are accepted and kept (``extra``) so a round trip writes them back unchanged.
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
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "DSparkConfig":
        """Validate a DeepSpec draft config dict.

        Raises:
            DraftConfigError: a required field is missing or malformed (the message names it and the fix).
        """
        if not isinstance(d, dict):
            raise DraftConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        missing = [k for k in REQUIRED_FIELDS if k not in d]
        if missing:
            raise DraftConfigError(f"{source}: missing DSpark/target field(s) {missing}; a DeepSpec draft config "
                                   f"is the target's config plus {list(DSPARK_FIELDS)}")

        def _int(name, lo=None):
            v = d[name]
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
        head_dim = d.get("head_dim") or hidden // heads
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
        known = set(REQUIRED_FIELDS) | set(DSPARK_FIELDS) | {"head_dim", "rope_theta", "draft_vocab_size",
                                                            "frozen_from_target"}
        return cls(hidden_size=hidden, intermediate_size=_int("intermediate_size", 1),
                   num_hidden_layers=_int("num_hidden_layers", 1), num_attention_heads=heads,
                   num_key_value_heads=_int("num_key_value_heads", 1), head_dim=int(head_dim), vocab_size=vocab,
                   rms_norm_eps=float(d["rms_norm_eps"]), rope_theta=_rope_theta(d),
                   block_size=_int("block_size", 1), target_layer_ids=list(ids), mask_token_id=mask_id,
                   markov_rank=rank, markov_head_type=mtype if rank > 0 else None,
                   enable_confidence_head=conf, confidence_head_with_markov=with_markov,
                   num_anchors=int(d.get("num_anchors", 512)), num_target_layers=ntl, draft_vocab_size=dvs,
                   frozen_from_target=bool(d.get("frozen_from_target", False)),
                   extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        """The DeepSpec-style config.json dict (copied target fields first, DSpark fields after)."""
        d = dict(self.extra)
        d.setdefault("architectures", ["Qwen3DSparkModel"])
        d.setdefault("model_type", "qwen3")
        d.update({k: v for k, v in asdict(self).items() if k != "extra" and v is not None})
        d["attention_bias"] = False
        d["hidden_act"] = "silu"
        d["tie_word_embeddings"] = False
        if d.get("markov_head_type") is None:
            d.pop("markov_head_type", None)
        if not self.draft_vocab_size:
            d.pop("draft_vocab_size", None)
        if not self.frozen_from_target:
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
    """RMSNorm as in Qwen2/3: x · rsqrt(mean(x²) + eps) · weight, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope(x, positions, theta: float):
    """Rotary embedding (rotate-half convention) of x [b, h, n, hd] at integer positions [b, n]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv  # [b, n, hd/2]
    emb = torch.cat([ang, ang], dim=-1).unsqueeze(1)  # [b, 1, n, hd]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DraftAttention(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.c = c
        h, kv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, h * hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, kv * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)

    def kv(self, x, positions):
        """Keys/values of x [b, n, d] at positions [b, n] -> ([b, kvh, n, hd], [b, kvh, n, hd])."""
        b, n, _ = x.shape
        c = self.c
        k = self.k_norm(self.k_proj(x).view(b, n, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rope(k, positions, c.rope_theta), v

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        """x [b, q, d] block states; ctx_k/v [b, kvh, C, hd]; mask bool [b, 1, q, C+q] (True = attend)."""
        b, q, _ = x.shape
        c = self.c
        qs = self.q_norm(self.q_proj(x).view(b, q, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        qs = rope(qs, positions, c.rope_theta)
        bk, bv = self.kv(x, positions)
        k = torch.cat([ctx_k, bk], dim=2)
        v = torch.cat([ctx_v, bv], dim=2)
        groups = c.num_attention_heads // c.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(qs, k.transpose(-1, -2)) * (1.0 / math.sqrt(c.head_dim))
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.self_attn = DraftAttention(c)
        self.mlp = DraftMLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(c.feature_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.out_vocab, bias=False)
        self.markov_head = MarkovHead(c) if c.markov_rank > 0 else None
        self.confidence_head = None
        if c.enable_confidence_head:
            self.confidence_head = ConfidenceHead(c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0))
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
    def context_kv(self, features, positions):
        """Per-layer context K/V of target features [b, n, m·d] at positions [b, n] -> [(k, v)] [b, kvh, n, hd]."""
        ctx = self.hidden_norm(self.fc(features))
        return [layer.self_attn.kv(ctx, positions) for layer in self.layers]

    def block_hidden(self, block_ids, positions, ctx_kv, mask):
        """Normed block hidden states [b, q, d] from block token ids [b, q] (anchor, masks...) at positions [b, q].

        ctx_kv: per-layer (k, v) [b, kvh, C, hd]; mask bool [b, 1, q, C + q], True = attend.
        """
        x = self.embed_tokens(block_ids)
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
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        s[p + "self_attn.q_proj.weight"] = (c.num_attention_heads * hd, d)
        s[p + "self_attn.k_proj.weight"] = (c.num_key_value_heads * hd, d)
        s[p + "self_attn.v_proj.weight"] = (c.num_key_value_heads * hd, d)
        s[p + "self_attn.o_proj.weight"] = (d, c.num_attention_heads * hd)
        s[p + "self_attn.q_norm.weight"] = (hd,)
        s[p + "self_attn.k_norm.weight"] = (hd,)
        s[p + "mlp.gate_proj.weight"] = (c.intermediate_size, d)
        s[p + "mlp.up_proj.weight"] = (c.intermediate_size, d)
        s[p + "mlp.down_proj.weight"] = (d, c.intermediate_size)
        s[p + "input_layernorm.weight"] = (d,)
        s[p + "post_attention_layernorm.weight"] = (d,)
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
        DraftConfigError: missing file, bad JSON, or a missing/malformed DSpark field.
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
    """Load a DeepSpec-layout drafter (``config.json`` + ``*.safetensors``).

    Args:
        target_embed, target_lm_head: the target's embedding / LM head weights [V, d]; required when the
            checkpoint omits its frozen copies (``frozen_from_target``), ignored otherwise.
    Raises:
        DraftConfigError: a missing or mis-shaped tensor, a bad config, or missing target weights.
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
    has_frozen = "embed_tokens.weight" in tensors and "lm_head.weight" in tensors
    want = expected_shapes(c, include_frozen=has_frozen)
    missing = [n for n in want if n not in tensors]
    if missing:
        raise DraftConfigError(f"{path}: checkpoint lacks tensor(s) {missing[:6]}{' ...' if len(missing) > 6 else ''} "
                               f"required by its config.json")
    for n, shape in want.items():
        if tuple(tensors[n].shape) != tuple(shape):
            raise DraftConfigError(f"{path}: tensor {n!r} has shape {tuple(tensors[n].shape)}, the config implies "
                                   f"{tuple(shape)}")
    model = DSparkDrafter(c)
    sd = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in tensors.items() if n in want}
    if not has_frozen:
        if target_embed is None or target_lm_head is None:
            raise DraftConfigError(f"{path}: the checkpoint omits the frozen embedding/LM head "
                                   "(frozen_from_target); pass the target's weights")
        sd["embed_tokens.weight"] = target_embed.to(dtype)
        lm = target_lm_head.to(dtype)
        sd["lm_head.weight"] = lm if "draft_vocab_ids" not in sd else lm[sd["draft_vocab_ids"]]
    model.load_state_dict(sd, strict=True)
    model.config.frozen_from_target = not has_frozen
    return model


def qwen2_draft_config(target_config: dict, *, mask_token_id: int, num_layers: int = 1,
                       intermediate_size: int | None = None, block_size: int = 7, target_layer_ids=(1, 13, 25),
                       markov_rank: int = 64, markov_head_type: str = "vanilla", draft_vocab_size: int | None = None,
                       confidence_head_with_markov: bool = True) -> DSparkConfig:
    """A DSpark config for a Qwen2/Qwen2.5/Llama-family target: hidden size, heads and RoPE from the target,
    DeepSpec's Qwen3 layer otherwise (q/k norm, no attention bias)."""
    d = dict(target_config)
    d.update(num_target_layers=int(target_config["num_hidden_layers"]), num_hidden_layers=num_layers,
             block_size=block_size, target_layer_ids=list(target_layer_ids), mask_token_id=int(mask_token_id),
             markov_rank=markov_rank, markov_head_type=markov_head_type, enable_confidence_head=True,
             confidence_head_with_markov=confidence_head_with_markov and markov_rank > 0, num_anchors=512)
    if intermediate_size:
        d["intermediate_size"] = intermediate_size
    if draft_vocab_size:
        d["draft_vocab_size"] = draft_vocab_size
    d.pop("architectures", None)
    d.pop("attention_bias", None)
    return DSparkConfig.from_dict(d, source="target config")
