"""Trace a Hugging Face decoder (target/verifier or draft LM) to an ONNX graph with an explicit
KV cache, then validate the graph against the torch model.

The graph interface is declared once in :mod:`dspark_runtime.engine_dir.graphspec`; input/output names,
dynamic axes and the validation checks below are all derived from that declaration.

The wrapper runs the model's own modules (embedding, rotary embedding, decoder layers, final
norm, LM head) with a tiny explicit cache object, so the graph takes past keys/values as plain
inputs and returns past+new keys/values (the *growing* layout, docs/design.md section 2) plus the
hidden states of the requested layers (DeepSpec indexing: -1 = embedding output, i = output of
decoder layer i), which DSpark drafters consume.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from dspark_runtime.backends.ort import OrtDecoder
from dspark_runtime.engine_dir.graphspec import (GQA_MODEL_TYPES, KV_LAYOUT_GROWING, KV_LAYOUT_SCATTER, LOGITS_FROM,
                                                 LOGITS_TO, DecoderDims, GraphSpec, attention_rows_per_query,
                                                 causal_lm_spec, past_names)
from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.scatter import ScatterRunner

OPSET = 18
# torch.export specialises axes of size 0 or 1: trace with sizes that are neither.
TRACE_BATCH, TRACE_Q, TRACE_PAST = 2, 3, 5


def load_hf_model(path: str | Path):
    """Load a Hugging Face causal LM folder in float32 with eager attention, in eval mode.

    Raises DSparkError when the folder is missing or holds no causal LM.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise DSparkError(
            f"no Hugging Face model at {path} (config.json missing); "
            "fetch it first with `dspark-export fetch <model>` or pass a model folder"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def decoder_dims(config, feature_layers=()) -> DecoderDims:
    """Read the graph dimensions from a transformers config.

    ``feature_layers`` use DeepSpec indexing (-1 = embeddings, i = output of layer i) and must lie
    in ``[-1, num_hidden_layers - 1]``; raises DSparkError otherwise.
    """
    n = config.num_hidden_layers
    for i in feature_layers:
        if not -1 <= i < n:
            raise DSparkError(f"feature layer {i} out of range: the model has {n} layers (use -1..{n - 1})")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return DecoderDims(
        num_layers=n,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        feature_layers=tuple(int(i) for i in feature_layers),
    )


class _ExplicitCache:
    """Minimal stand-in for a transformers ``Cache``: concatenates the past given as graph inputs
    with the new keys/values and keeps the result as the graph's present outputs."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]]):
        self.past = past
        self.present: list = [None] * len(past)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        pk, pv = self.past[layer_idx]
        k = torch.cat([pk, key_states], dim=-2)
        v = torch.cat([pv, value_states], dim=-2)
        self.present[layer_idx] = (k, v)
        return k, v


class _ScatterCache:
    """The *scatter* layout's cache (docs in :mod:`dspark_runtime.engine_dir.graphspec`): writes the new keys/values into the
    past slot buffers at each row's positions and attends over the whole buffers; the graph's K/V outputs are the
    new entries (``present``) and the written buffers (``slots``, which the runtime binds to the past inputs' memory
    so the write happens in place)."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]], position_ids: torch.Tensor):
        self.past = past
        self.position_ids = position_ids  # [b, q]
        self.present: list = [None] * len(past)
        self.slots: list = [None] * len(past)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        pk, pv = self.past[layer_idx]
        b, h, q, d = key_states.shape
        idx = self.position_ids[:, None, :, None].expand(b, h, q, d)
        self.present[layer_idx] = (key_states, value_states)
        self.slots[layer_idx] = (pk.scatter(2, idx, key_states), pv.scatter(2, idx, value_states))
        return self.slots[layer_idx]


# Model types whose eager attention is plain softmax(q k^T * scaling + mask) v over repeated KV heads
# (no softcapping, no sinks): for them the export uses the grouped form below, the same function.
GQA_ATTENTION = "dspark_gqa"


def grouped_query_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Grouped-query attention without repeating the KV heads (the transformers attention interface).

    query float32 [b, H, q, d]; key, value [b, kv, t, d] with H = g * kv; attention_mask additive
    float32 [b, 1, q, t] or None. Returns (attn_output [b, q, H, d], None). The same function as
    transformers' eager attention (``repeat_kv`` then softmax(q k^T * scaling + mask) v, softmax in
    float32), computed per KV head on its g query heads stacked as g*q rows, so the exported graph
    never materialises g copies of the cache (an Expand of [b, H, t, d] per layer and step: ~700 MB
    of writes per step at 2,048 cached positions on Qwen2.5-1.5B; docs/design.md section 2).
    """
    b, h, q, d = query.shape
    kv, t = key.shape[1], key.shape[2]
    g = h // kv
    qg = query.reshape(b, kv, g * q, d)
    w = torch.matmul(qg, key.transpose(2, 3)) * scaling  # [b, kv, g*q, t]
    w = w.reshape(b, kv, g, q, t)
    if attention_mask is not None:
        w = w + attention_mask[:, :, None, :, :t]
    w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w.reshape(b, kv, g * q, t), value)  # [b, kv, g*q, d]
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous(), None


def _register_gqa() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_ATTENTION, grouped_query_attention)


def rms_norm_div_form(self, hidden_states):
    """RMSNorm (Qwen2/Llama/Mistral/Qwen3: ``weight * x / sqrt(mean(x^2) + eps)``, in float32) written with a
    division, the form ONNX Runtime's SimplifiedLayerNormFusion recognises: every norm of the graph becomes one
    ``SimplifiedLayerNormalization`` node instead of five (transformers writes ``x * rsqrt(...)``, exported as
    Sqrt + Reciprocal + Mul, which the fusion does not match). Equal to transformers' form to float rounding."""
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x / torch.sqrt(variance + self.variance_epsilon)).to(dtype)


class _ExportForms:
    """Context manager: while exporting, the model's layers use ``attention`` as their attention function
    (None: their own) and, for the model types in :data:`GQA_MODEL_TYPES`, their RMSNorms the division form;
    on exit the model is as it was (the torch reference keeps transformers' own functions)."""

    def __init__(self, model):
        self.model, self.config = model, model.config
        self.attention = export_attention(model)
        self.prev = None
        self.norms = []
        if self.config.model_type in GQA_MODEL_TYPES:
            self.norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")
                          and hasattr(m, "variance_epsilon") and getattr(m, "weight", None) is not None]

    def __enter__(self):
        if self.attention is not None:
            self.prev = self.config._attn_implementation_internal
            self.config._attn_implementation_internal = self.attention
        for m in self.norms:
            m.forward = types.MethodType(rms_norm_div_form, m)
        return self

    def __exit__(self, *exc):
        if self.attention is not None:
            self.config._attn_implementation_internal = self.prev
        for m in self.norms:
            del m.forward  # back to the class's forward
        return False


def export_attention(model) -> str | None:
    """The attention function the export uses for ``model``: the grouped form for the model types in
    :data:`GQA_MODEL_TYPES` whose heads are grouped (None: the model's own eager attention)."""
    cfg = model.config
    if attention_rows_per_query({"model_type": cfg.model_type, "num_attention_heads": cfg.num_attention_heads,
                                 "num_key_value_heads": getattr(cfg, "num_key_value_heads", None)}) == 1:
        return None
    _register_gqa()
    return GQA_ATTENTION


class DecoderWrapper(nn.Module):
    """forward(input_ids, position_ids, attention_mask, *past_flat) -> (logits, [features], *present_flat[, *slots_flat]).

    Shapes and dtypes follow :func:`dspark_runtime.engine_dir.graphspec.causal_lm_spec`. The boolean mask is
    turned into an additive float mask (0 where True, the dtype's minimum where False).
    """

    def __init__(self, model, dims: DecoderDims, kv_layout: str = KV_LAYOUT_GROWING):
        super().__init__()
        self.model = model
        self.dims = dims
        self.kv_layout = kv_layout

    def forward(self, input_ids, position_ids, attention_mask, *past_flat):
        base = self.model.model
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(self.dims.num_layers)]
        cache = _ScatterCache(past, position_ids) if self.kv_layout == KV_LAYOUT_SCATTER else _ExplicitCache(past)
        min_val = torch.finfo(torch.float32).min
        mask = torch.where(attention_mask, torch.zeros((), dtype=torch.float32), torch.full((), min_val))
        h = base.embed_tokens(input_ids)
        pos_emb = base.rotary_emb(h, position_ids)
        feats = {}
        if -1 in self.dims.feature_layers:
            feats[-1] = h
        for i, layer in enumerate(base.layers[: self.dims.num_layers]):
            h = layer(h, attention_mask=mask, position_ids=position_ids, cache=cache, position_embeddings=pos_emb)
            if isinstance(h, tuple):  # older layer signatures return tuples
                h = h[0]
            if i in self.dims.feature_layers:
                feats[i] = h
        logits = self.model.lm_head(base.norm(h))
        outs = [logits]
        if self.dims.feature_layers:
            outs.append(torch.cat([feats[i] for i in self.dims.feature_layers], dim=-1))
        for k, v in cache.present:
            outs += [k, v]
        if self.kv_layout == KV_LAYOUT_SCATTER:
            for k, v in cache.slots:
                outs += [k, v]
        return tuple(outs)


def _example_inputs(dims: DecoderDims, batch: int, q: int, past: int, ids=None, kv_layout: str = KV_LAYOUT_GROWING):
    g = torch.Generator().manual_seed(0)
    if ids is None:
        ids = torch.randint(0, dims.vocab_size, (batch, q), generator=g)
    pos = torch.arange(past, past + q).unsqueeze(0).expand(batch, q).contiguous()
    # scatter: slot buffers with room for the new positions and one masked slot after them
    slots = past + q + 1 if kv_layout == KV_LAYOUT_SCATTER else past
    mask = torch.ones(batch, 1, q, slots + (0 if kv_layout == KV_LAYOUT_SCATTER else q), dtype=torch.bool)
    mask = mask.tril(diagonal=past)
    kv = []
    for _ in range(dims.num_layers):
        for _ in range(2):
            kv.append(torch.randn(batch, dims.num_kv_heads, slots, dims.head_dim, generator=g) * 0.1)
    return (ids, pos, mask, *kv)


def _rename_dynamic_dims(model_proto: onnx.ModelProto, spec: GraphSpec) -> None:
    """Give the graph's dynamic axes the names declared in ``spec`` (dynamo names them s0, s1...)."""
    for values, decls in ((model_proto.graph.input, spec.inputs), (model_proto.graph.output, spec.outputs)):
        by_name = {t.name: t for t in decls}
        for vi in values:
            decl = by_name.get(vi.name)
            if decl is None:
                raise DSparkError(f"exported graph has an undeclared tensor {vi.name!r}")
            dims = vi.type.tensor_type.shape.dim
            if len(dims) != len(decl.shape):
                raise DSparkError(f"{vi.name}: exported rank {len(dims)} != declared {len(decl.shape)}")
            for d, want in zip(dims, decl.shape):
                if isinstance(want, str):
                    d.ClearField("dim_value")
                    d.dim_param = want


def export_decoder(model, dims: DecoderDims, out_path: Path, kv_layout: str = KV_LAYOUT_GROWING) -> GraphSpec:
    """Export ``model`` as a decoder graph to ``out_path`` (+ ``out_path.data`` external weights).

    ``kv_layout``: "growing" (past in, past + new out) or "scatter" (slot buffers in, new entries out; see
    :mod:`dspark_runtime.engine_dir.graphspec`). Returns the GraphSpec the graph was exported with. Uses
    ``torch.onnx.export(dynamo=True)``, opset 18, dynamic batch / q_len / cache axes. Raises DSparkError on a
    trace failure or another layout.
    """
    if kv_layout not in (KV_LAYOUT_GROWING, KV_LAYOUT_SCATTER):
        raise DSparkError(f"the exporter writes the growing or scatter KV layout, not {kv_layout!r} (the capacity "
                          "layout is made from a growing graph by `dspark-export build-trt`)")
    spec = causal_lm_spec(dims, kv_layout)
    traced = [t for t in spec.inputs if t.name not in (LOGITS_FROM, LOGITS_TO)]  # added after the trace
    wrapper = DecoderWrapper(model, dims, kv_layout).eval()
    args = _example_inputs(dims, TRACE_BATCH, TRACE_Q, TRACE_PAST, kv_layout=kv_layout)
    dyn = torch.export.Dim.DYNAMIC
    shapes = [{ax: dyn for ax in t.dynamic_axes()} for t in traced]
    dynamic_shapes = (*shapes[:3], tuple(shapes[3:]))  # forward(ids, pos, mask, *past)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # torch.onnx notes every torchvision op it cannot register; irrelevant to decoders
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings(), _ExportForms(model):
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        try:
            prog = torch.onnx.export(
                wrapper,
                args,
                dynamo=True,
                input_names=[t.name for t in traced],
                output_names=spec.output_names,
                dynamic_shapes=dynamic_shapes,
                opset_version=OPSET,
                optimize=True,
                verbose=False,
            )
        except Exception as e:  # surface the exporter's message, not its stack
            raise DSparkError(f"ONNX export of {type(model).__name__} failed: {e}") from e
    proto = prog.model_proto  # a new proto each time it is read
    del prog
    if LOGITS_FROM in spec.input_names:
        add_logits_range(proto)
    save_graph(proto, spec, out_path)
    del proto
    print(f"  exported {out_path.name} in {time.perf_counter() - t0:.1f}s")
    return spec


def add_logits_range(proto: onnx.ModelProto) -> None:
    """Give a decoder graph the ``logits_from`` and ``logits_to`` inputs (int64 [1] each,
    :mod:`dspark_runtime.engine_dir.graphspec`): a ``Slice`` of the LM head's input to query positions
    ``logits_from..logits_to - 1`` (axis 1), so a prompt chunk computes the logits of its last position only (the LM
    head is ~12% of a 64-token pass of the 1.5B int4 target; docs/serving.md) and a call padded for row invariance
    those of its real positions only. The head is found from the ``logits`` output back along first inputs to the
    first MatMul / Gemm / MatMulNBits; only it is rewired. In place. Raises DSparkError when the graph has no such
    path or already has the inputs."""
    from onnx import TensorProto, helper, numpy_helper

    g = proto.graph
    if any(i.name in (LOGITS_FROM, LOGITS_TO) for i in g.input):
        raise DSparkError(f"the graph already has a {LOGITS_FROM!r} / {LOGITS_TO!r} input")
    prod = {o: n for n in g.node for o in n.output}
    head, chain = prod.get("logits"), []
    while head is not None and head.op_type not in ("MatMul", "Gemm", "MatMulNBits"):
        chain.append(head)
        head = prod.get(head.input[0]) if head.input else None
    if head is None:
        raise DSparkError("no LM head MatMul found on the path to the graph's 'logits' output")
    x = head.input[0]
    axes = f"{LOGITS_FROM}_axes"
    g.initializer.append(numpy_helper.from_array(np.array([1], np.int64), axes))
    g.input.extend([helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in (LOGITS_FROM, LOGITS_TO)])
    sliced = f"{x}_{LOGITS_FROM}"
    at = list(g.node).index(head)
    g.node.insert(at, helper.make_node("Slice", [x, LOGITS_FROM, LOGITS_TO, axes], [sliced], name=f"{LOGITS_FROM}_slice"))
    head.input[0] = sliced
    stale = {o for n in (head, *chain) for o in n.output}  # their recorded shapes had q_len positions
    keep = [vi for vi in g.value_info if vi.name not in stale]
    del g.value_info[:]
    g.value_info.extend(keep)


def save_graph(proto: onnx.ModelProto, spec: GraphSpec, out_path: Path) -> None:
    """Name the dynamic axes as ``spec`` declares and save ``out_path`` + ``out_path.data`` (external
    weights, one file), replacing any previous pair."""
    _rename_dynamic_dims(proto, spec)
    data_name = out_path.name + ".data"
    for p in (out_path, out_path.with_name(data_name)):
        if p.exists():
            p.unlink()
    onnx.save_model(proto, str(out_path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=1024)


@dataclass
class ValidationReport:
    """Graph-vs-torch agreement (logits in float32).

    prefill_*: the prompt fed with an empty past (past_len = 0); verify_*: 5 more tokens fed on
    top of the prefill's KV cache, compared with torch's full-sequence forward at those positions.
    """

    prefill_max_abs_logit_diff: float
    prefill_argmax_agreement: float
    verify_max_abs_logit_diff: float
    verify_argmax_agreement: float
    features_max_abs_diff: float | None
    tolerance_logits: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TorchReference:
    """The torch model's outputs on the validation ids, computed before export so the model can be
    freed before ONNX Runtime loads the graph (peak memory: one copy of the weights, not two).

    logits: float32 [n, vocab]; features: float32 [n, m * hidden] or None (None also when a
    feature layer is the last one, which transformers reports after the final norm).
    """

    token_ids: list
    logits: np.ndarray
    features: np.ndarray | None


def torch_reference(model, dims: DecoderDims, token_ids: list[int]) -> TorchReference:
    """Full-sequence forward of ``model`` on ``token_ids`` (no KV cache)."""
    ids = torch.tensor([token_ids], dtype=torch.int64)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=bool(dims.feature_layers))
    feats = None
    if dims.feature_layers and dims.num_layers - 1 not in dims.feature_layers:
        hs = ref.hidden_states  # hs[0] = embeddings, hs[i + 1] = output of layer i
        feats = np.concatenate([hs[i + 1][0].numpy() for i in dims.feature_layers], axis=-1)
    return TorchReference(list(token_ids), ref.logits[0].float().numpy(), feats)


def validate_decoder(ref: TorchReference, dims: DecoderDims, onnx_path: Path, tolerance: float = 1e-2,
                     n_verify: int = 5, strict: bool = True, kv_layout: str = KV_LAYOUT_GROWING,
                     kernels: str = "") -> ValidationReport:
    """Run the ONNX graph (ONNX Runtime CPU) on the reference's token ids and compare.

    The prompt is fed with an empty past (past_len = 0), then its last ``n_verify`` tokens as a
    verify step on top of that KV cache. With ``strict`` (fp32 graphs) raises DSparkError when the
    logits differ by more than ``tolerance`` or any argmax disagrees; quantized graphs pass
    ``strict=False`` and only report their agreement. ``kernels``: the custom-op library beside the graph its
    ``ai.dspark`` nodes need (:attr:`GraphSpec.kernels`).
    """
    if len(ref.token_ids) < n_verify + 2:
        raise DSparkError("validation prompt too short")
    dec = OrtDecoder(onnx_path, dataclasses.replace(causal_lm_spec(dims, kv_layout), kernels=kernels), threads=2).activate()
    ids = np.asarray(ref.token_ids, dtype=np.int64)[None]
    n = ids.shape[1] - n_verify
    if kv_layout == KV_LAYOUT_SCATTER:
        sr = ScatterRunner(dec)
        sr.add(0)
        logits = [sr.step([(0, list(ids[0, :n]))])[0], sr.step([(0, list(ids[0, n:]))])[0]]
        feats = sr.features(0)
        got_f = None if feats is None else np.array(feats)
    else:
        out1 = dec.step(ids[:, :n], np.arange(n)[None], _causal_mask(n, 0), dec.empty_kv(1))
        out2 = dec.step(ids[:, n:], np.arange(n, n + n_verify)[None], _causal_mask(n_verify, n), out1.kv)
        logits = [out1.logits[0], out2.logits[0]]
        got_f = None if out1.features is None else np.concatenate([out1.features[0], out2.features[0]], axis=0)
    dec.deactivate()
    got = np.concatenate(logits, axis=0)
    want = ref.logits
    pre_diff = float(np.abs(got[:n] - want[:n]).max())
    ver_diff = float(np.abs(got[n:] - want[n:]).max())
    pre_agree = float((got[:n].argmax(-1) == want[:n].argmax(-1)).mean())
    ver_agree = float((got[n:].argmax(-1) == want[n:].argmax(-1)).mean())
    feat_diff = None
    if ref.features is not None:
        feat_diff = float(np.abs(got_f - ref.features).max())
    rep = ValidationReport(pre_diff, pre_agree, ver_diff, ver_agree, feat_diff, tolerance)
    if strict and (max(pre_diff, ver_diff) > tolerance or min(pre_agree, ver_agree) < 1.0):
        raise DSparkError(f"graph {onnx_path.name} failed validation against torch: {rep.to_json()}")
    return rep


def _causal_mask(q: int, past: int) -> np.ndarray:
    """Boolean mask [1, 1, q, past + q]: query i sees key j iff j <= past + i."""
    return np.tril(np.ones((q, past + q), dtype=bool), k=past)[None, None]


__all__ = ["load_hf_model", "decoder_dims", "export_decoder", "torch_reference", "validate_decoder",
           "ValidationReport", "TorchReference",
           "DecoderWrapper", "past_names"]
