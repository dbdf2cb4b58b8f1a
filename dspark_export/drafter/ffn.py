"""The DSpark drafter's feed-forward blocks: the dense SwiGLU MLP (DeepSpec's) and the MoE option (our extension;
config fields :data:`dspark_export.drafter.families.MOE_FIELDS`), used by
:class:`dspark_export.drafter.model.DraftLayer`.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark_export.drafter.config import DSparkConfig


class DraftMLP(nn.Module):
    """down(act(gate(x)) · up(x)) with act = transformers' ``ACT2FN[hidden_act]`` (no biases).

    ``intermediate_size`` overrides the config's width (a :class:`DraftMoE` expert's is
    ``draft_moe_intermediate_size``).
    """

    def __init__(self, c: DSparkConfig, intermediate_size: int | None = None):
        super().__init__()
        from transformers.activations import ACT2FN

        width = intermediate_size or c.intermediate_size
        self.gate_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, c.hidden_size, bias=False)
        self.act_fn = ACT2FN[c.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftMoE(nn.Module):
    """The MoE FFN option of a draft layer (our extension; config ``draft_moe_experts`` = E,
    ``draft_moe_top_k`` = k, ``draft_moe_intermediate_size`` = each expert's width).

    Routing as Mixtral (Jiang et al. 2024, "Mixtral of Experts") / Qwen-MoE with normalised top-k weights:
    router logits ``gate(x)`` (a bias-free Linear d -> E, in the weights' dtype), softmax over the E experts in
    float32 (P [..., E]), the k largest kept and renormalised to sum to 1, everything else 0, so the routing weights
    W [..., E] are P_j / Σ_{i ∈ topk} P_i for the k chosen experts. Output = Σ_j W_j · expert_j(x), each expert a
    :class:`DraftMLP` (SwiGLU with the layer's activation). DeepSeek-V4's production DSpark drafter has MoE layers
    (DSpark paper); DeepSpec's public configs have none, hence our own config fields.

    **Cost.** Every expert is computed densely for every token and combined with W (zero outside the top-k):
    E expert MLPs per token instead of k — E/k times the FFN FLOPs of a sparse dispatch — so the drafter graph
    stays a fixed dataflow (no gather/scatter of tokens to experts, no data-dependent shapes) that
    ``torch.onnx`` exports with dynamic axes and ONNX Runtime reproduces exactly. Tokens per call are few (one
    block of γ per sequence), so this is cheap next to the target's verify pass.

    With k = 1 the renormalised weight is always 1: the router then learns only through
    :meth:`aux_loss` (Switch Transformer uses the unnormalised probability instead); prefer k >= 2.

    Each forward keeps the last router probabilities (``last_router_probs`` float32 [..., E]) and chosen
    experts (``last_topk`` int64 [..., k]) for :meth:`aux_loss`; exports (``torch.compiler.is_exporting()``)
    do not record them.
    """

    def __init__(self, c: DSparkConfig):
        super().__init__()
        self.num_experts, self.top_k = c.draft_moe_experts, c.draft_moe_top_k
        self.gate = nn.Linear(c.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList([DraftMLP(c, c.draft_moe_intermediate_size) for _ in range(self.num_experts)])
        self.last_router_probs = None
        self.last_topk = None

    def routing(self, x):
        """(P float32 [..., E] router probabilities, W float32 [..., E] routing weights, top-k ids int64 [..., k])
        of x [..., d]; W is P renormalised over the k largest and 0 elsewhere."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        return probs, torch.zeros_like(probs).scatter(-1, top_i, top_p), top_i

    def forward(self, x):
        """x [..., d] -> [..., d] in x's dtype (routing weights cast to it, as Mixtral does)."""
        probs, w, top_i = self.routing(x)
        if not torch.compiler.is_exporting():
            self.last_router_probs, self.last_topk = probs, top_i
        w = w.to(x.dtype)
        out = None
        for j, expert in enumerate(self.experts):  # dense: every expert, weighted (0 outside the top-k)
            y = expert(x) * w[..., j:j + 1]
            out = y if out is None else out + y
        return out

    def aux_loss(self, token_mask=None) -> torch.Tensor:
        """Switch-Transformer load-balancing loss (Fedus et al. 2021, eq. 4) of the last forward, float32 scalar:
        E · Σ_i f_i · P_i, with P_i the mean router probability of expert i and f_i the fraction of the tokens'
        k routing slots sent to expert i (Σ_i f_i = 1, so a perfectly balanced router scores 1 for any k;
        transformers' Mixtral ``load_balancing_loss_func`` equals k times this). Only P carries gradient.

        ``token_mask`` (bool or 0/1 over the forward's tokens: [b, q], or [b, A, γ] for q = A·γ, or anything
        broadcasting to [b, q]) restricts the means to real tokens (training: the blocks of kept anchors);
        None = every token.

        Raises:
            RuntimeError: no forward has run since the module was built.
        """
        if self.last_router_probs is None:
            raise RuntimeError("DraftMoE.aux_loss: no forward recorded the router probabilities yet")
        probs, top_i = self.last_router_probs, self.last_topk
        picked = torch.zeros_like(probs).scatter(-1, top_i, 1.0)  # [..., E], k ones per token
        shape = probs.shape[:-1]
        if token_mask is None:
            w = torch.ones(shape, dtype=torch.float32, device=probs.device)
        else:
            w = token_mask.to(device=probs.device, dtype=torch.float32)
            w = w.reshape(shape) if w.numel() == shape.numel() else w.expand(shape)
        n = w.sum().clamp_min(1.0)
        p_mean = (probs * w.unsqueeze(-1)).reshape(-1, self.num_experts).sum(0) / n
        f = (picked * w.unsqueeze(-1)).reshape(-1, self.num_experts).sum(0) / (n * self.top_k)
        return self.num_experts * (f * p_mean).sum()
