"""One declaration of the graph interfaces: inputs, outputs, dtypes and dynamic axes of each graph kind and KV layout
(:func:`causal_lm_spec`, :func:`dspark_draft_spec`), and the axis arithmetic built on it (:data:`DERIVED_AXES`,
:func:`resolve_axes`, :func:`tensor_shape`). The exporter derives the ONNX names and dynamic shapes from these
declarations, the validator its checks; the manifest records them and the runtime compares what it loads against
them. Nothing here imports torch.

KV layouts (docs/design.md section 2): *growing* (the cache grows by each call's ``q_len``), *capacity* (fixed-size
cache buffers in, only the new entries out: a step's shapes depend on (batch, q_len, bucket) alone, so a captured
CUDA graph replays) and *scatter* (one batch row per request, slot = position: a request's output does not depend on
what shares its call). :func:`causal_lm_spec` lists each layout's tensors.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

KV_LAYOUT_GROWING = "growing"
KV_LAYOUT_CAPACITY = "capacity"
KV_LAYOUT_SCATTER = "scatter"
KV_LAYOUTS = (KV_LAYOUT_GROWING, KV_LAYOUT_CAPACITY, KV_LAYOUT_SCATTER)

BATCH, Q_LEN, PAST_LEN, TOTAL_LEN = "batch", "q_len", "past_len", "total_len"
CAPACITY, KV_LEN = "capacity", "kv_len"
ARGMAX = "argmax"  # the capacity layout's (TensorRT's) extra output: argmax of the logits, int64 [batch, q_len]
SLOTS = "slots"
LOGITS_FROM = "logits_from"  # the scatter decoder's input: the first query position the LM head runs on
LOGITS_TO = "logits_to"  # ... and the query position it stops before
LOGITS_LEN = "logits_len"  # ... and its logits' position axis (logits_to - logits_from)
#: model types whose decoder graphs run attention per KV head on its query heads stacked as rows (the export's
#: grouped form, dspark_export.graphs.decoder.grouped_query_attention), where they have fewer KV heads than heads
GQA_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def attention_rows_per_query(model_config: dict) -> int:
    """Rows each attention MatMul of an exported decoder graph computes per query position, from the model's Hugging
    Face config (``model_type``, ``num_attention_heads``, ``num_key_value_heads``): the query heads per KV head in
    the grouped form (:data:`GQA_MODEL_TYPES` with fewer KV heads than heads), else 1 (the model's own attention,
    one row per head). A one-token call of Qwen2.5-1.5B (12 heads, 2 KV heads) multiplies 6 rows by the keys."""
    heads = int(model_config.get("num_attention_heads") or 1)
    kv = int(model_config.get("num_key_value_heads") or heads)
    if model_config.get("model_type") not in GQA_MODEL_TYPES or heads == kv:
        return 1
    return heads // kv


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output.

    ``shape`` entries are either ints (fixed) or axis names (dynamic); ``total_len`` is
    ``past_len + q_len``.
    """

    name: str
    dtype: str  # numpy dtype name: "int64", "float32", "bool"
    shape: tuple

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @staticmethod
    def from_json(d: dict) -> "TensorSpec":
        return TensorSpec(d["name"], d["dtype"], tuple(d["shape"]))

    def dynamic_axes(self) -> dict[int, str]:
        """Map axis index -> axis name for the dynamic axes of this tensor."""
        return {i: s for i, s in enumerate(self.shape) if isinstance(s, str)}


@dataclass(frozen=True)
class DecoderDims:
    """Model dimensions that fix the static parts of a decoder graph's shapes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    feature_layers: tuple = ()  # DeepSpec indexing: -1 = embedding output, i = output of layer i

    def to_json(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @staticmethod
    def from_json(d: dict) -> "DecoderDims":
        d = dict(d)
        d["feature_layers"] = tuple(d.get("feature_layers", ()))
        return DecoderDims(**d)


@dataclass(frozen=True)
class GraphSpec:
    """The full interface of one graph: ordered inputs and outputs, and the custom-op library its ``ai.dspark``
    nodes need (``kernels``: a file name beside the graph, :mod:`dspark_runtime.kernels`; "" for none)."""

    kind: str
    kv_layout: str
    inputs: tuple
    outputs: tuple
    dims: DecoderDims = field(default=None)
    kernels: str = ""

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "kv_layout": self.kv_layout,
            "dims": self.dims.to_json(),
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            **({"kernels": self.kernels} if self.kernels else {}),
        }

    @staticmethod
    def from_json(d: dict) -> "GraphSpec":
        return GraphSpec(
            kind=d["kind"],
            kv_layout=d["kv_layout"],
            inputs=tuple(TensorSpec.from_json(t) for t in d["inputs"]),
            outputs=tuple(TensorSpec.from_json(t) for t in d["outputs"]),
            dims=DecoderDims.from_json(d["dims"]),
            kernels=d.get("kernels", ""),
        )


def past_names(num_layers: int) -> list[tuple[str, str]]:
    """Names of the past KV inputs, ``[(past.0.key, past.0.value), ...]``."""
    return [(f"past.{i}.key", f"past.{i}.value") for i in range(num_layers)]


def present_names(num_layers: int) -> list[tuple[str, str]]:
    """Names of the present KV outputs, ``[(present.0.key, present.0.value), ...]``."""
    return [(f"present.{i}.key", f"present.{i}.value") for i in range(num_layers)]


def new_names(num_layers: int) -> list[tuple[str, str]]:
    """Names of the new-entry KV outputs of the capacity layout, ``[(new.0.key, new.0.value), ...]``."""
    return [(f"new.{i}.key", f"new.{i}.value") for i in range(num_layers)]


def slot_names(num_layers: int) -> list[tuple[str, str]]:
    """Names of the scatter layout's written slot buffers, ``[(slots.0.key, slots.0.value), ...]``."""
    return [(f"slots.{i}.key", f"slots.{i}.value") for i in range(num_layers)]


def slot_bindings(spec: GraphSpec) -> dict:
    """{past input name: slot output name} of a scatter graph exported with its written slot buffers as outputs, the
    pairs a call binds to one memory (:class:`dspark_runtime.backends.slot_binding.SlotBinding`); {} for any other graph."""
    if spec.dims is None or spec.kv_layout != KV_LAYOUT_SCATTER:
        return {}
    outs = set(spec.output_names)
    return {p: s for ps, ss in zip(past_names(spec.dims.num_layers), slot_names(spec.dims.num_layers))
            for p, s in zip(ps, ss) if s in outs}


def slot_call_outputs(spec: GraphSpec) -> list:
    """The outputs a call of a graph with slot outputs (:func:`slot_bindings`) returns, in the spec's order: every
    output but the K/V ones (the new entries are in the written slot buffers)."""
    n = spec.dims.num_layers
    kv = {name for names in (present_names(n), new_names(n), slot_names(n)) for pair in names for name in pair}
    return [name for name in spec.output_names if name not in kv]


def causal_lm_spec(dims: DecoderDims, kv_layout: str = KV_LAYOUT_GROWING) -> GraphSpec:
    """Declare the decoder graph (verifier or draft LM) for ``dims``.

    ``kv_layout``: "growing" (past in, past + new out), "capacity" (cache buffers in, new entries
    out) or "scatter" (slot buffers in, new entries written into them inside the graph, new entries and the written
    buffers out). Raises
    ValueError for another layout. The tensors::

    Decoder graph ("causal_lm", docs/design.md section 2, *growing* KV layout)
    ----------------------------------------------------------------------
    inputs
      input_ids       int64   [batch, q_len]
      position_ids    int64   [batch, q_len]
      attention_mask  bool    [batch, 1, q_len, past_len + q_len]   True = may attend
      past.{i}.key    float32 [batch, kv_heads, past_len, head_dim]  for each layer i
      past.{i}.value  float32 [batch, kv_heads, past_len, head_dim]
    outputs
      logits          float32 [batch, q_len, vocab]
      features        float32 [batch, q_len, m * hidden]  (only if feature layers are requested)
      present.{i}.key   float32 [batch, kv_heads, past_len + q_len, head_dim]
      present.{i}.value float32 [batch, kv_heads, past_len + q_len, head_dim]

    ``q_len`` is the candidate-length axis: prefill chunks and ``1 + verify length`` tokens use the
    same graph.

    *Capacity* KV layout (TensorRT with CUDA graphs, docs/design.md section 2): the same decoder, but the
    cache inputs are fixed-size buffers and only the new entries come out, so every input and output
    shape of a step depends on (batch, q_len, capacity bucket) alone and a captured CUDA graph can be
    replayed. Slots the request has not written are hidden by the mask; the runtime writes the new
    keys/values into the buffers at the request's positions.

    inputs
      input_ids, position_ids  int64 [batch, q_len]
      attention_mask  bool    [batch, 1, q_len, capacity + q_len]       (``kv_len``)
      past.{i}.key/value float32 [batch, kv_heads, capacity, head_dim]  the cache buffers (a capacity bucket)
    outputs
      logits, features  as above
      new.{i}.key/value float32 [batch, kv_heads, q_len, head_dim]      keys (after RoPE) / values of the q_len tokens
      argmax          int64   [batch, q_len]   argmax of the logits (lowest index on ties in ONNX; TensorRT's TopK
                                               decides its ties), so greedy decoding need not copy the logits back

    *Scatter* KV layout (one batch row per request, exact whatever shares the call): the cache inputs are per-row
    slot buffers indexed by position; the graph writes each row's new keys/values into its buffer at that row's
    ``position_ids`` (``ScatterElements`` on the slot axis) and attends over the whole buffer, so row r always sees
    [its cached keys][its new keys][masked slots] — the same contiguous key block at offset 0 that a call of that
    request alone sees (ONNX Runtime's CPU Softmax/MatMul give bit-identical results for such a block whatever masked
    slots follow it; a masked gap *inside* the block, which a shared past of mixed lengths forces, does not).

    inputs
      input_ids, position_ids  int64 [batch, q_len]        position_ids < slots
      attention_mask  bool    [batch, 1, q_len, slots]
      past.{i}.key/value float32 [batch, kv_heads, slots, head_dim]  slot buffers (slot = position)
      logits_from     int64   [1]   the LM head runs on query positions logits_from..logits_to - 1 of every row
      logits_to       int64   [1]   (0, q_len: all; a prompt chunk needs its last position only, a padded call its
                                    real positions). Graphs exported before them lack them: all positions (before
                                    logits_to alone: logits_from..q_len - 1)
    outputs
      logits          float32 [batch, logits_len, vocab]   logits_len = logits_to - logits_from
      features        as above (every position)
      new.{i}.key/value float32 [batch, kv_heads, q_len, head_dim]   the new entries
      slots.{i}.key/value float32 [batch, kv_heads, slots, head_dim] the slot buffers with the new entries written in
                                     (the ScatterElements' results). The runtime binds each to its past input's memory
                                     (IOBinding), so ONNX Runtime writes the new entries into the runtime's buffers in
                                     place instead of copying every buffer per call. Graphs exported before them lack
                                     them: the runtime then writes the new entries into its buffers itself.
    """
    if kv_layout == KV_LAYOUT_CAPACITY:
        return _causal_lm_capacity_spec(dims)
    if kv_layout == KV_LAYOUT_SCATTER:
        spec = _causal_lm_layout_spec(dims, KV_LAYOUT_SCATTER, mask_len=SLOTS, cache_len=SLOTS, out_len=Q_LEN,
                                      out_names=new_names(dims.num_layers))
        slots = tuple(TensorSpec(n, "float32", (BATCH, dims.num_kv_heads, SLOTS, dims.head_dim))
                      for pair in slot_names(dims.num_layers) for n in pair)
        outputs = (TensorSpec("logits", "float32", (BATCH, LOGITS_LEN, dims.vocab_size)), *spec.outputs[1:], *slots)
        head_range = (TensorSpec(LOGITS_FROM, "int64", (1,)), TensorSpec(LOGITS_TO, "int64", (1,)))
        return GraphSpec(spec.kind, spec.kv_layout, (*spec.inputs, *head_range), outputs, dims)
    if kv_layout != KV_LAYOUT_GROWING:
        raise ValueError(f"unknown KV layout {kv_layout!r}; choose one of {KV_LAYOUTS}")
    return _causal_lm_layout_spec(dims, KV_LAYOUT_GROWING, mask_len=TOTAL_LEN, cache_len=PAST_LEN,
                                  out_len=TOTAL_LEN, out_names=present_names(dims.num_layers))


def _causal_lm_capacity_spec(dims: DecoderDims) -> GraphSpec:
    spec = _causal_lm_layout_spec(dims, KV_LAYOUT_CAPACITY, mask_len=KV_LEN, cache_len=CAPACITY,
                                  out_len=Q_LEN, out_names=new_names(dims.num_layers))
    # the argmax of the logits, taken on the device: a greedy request copies 8 bytes a position back, not the vocab
    argmax = TensorSpec(ARGMAX, "int64", (BATCH, Q_LEN))
    return GraphSpec(spec.kind, spec.kv_layout, spec.inputs, (*spec.outputs, argmax), dims)


def _causal_lm_layout_spec(dims: DecoderDims, layout: str, *, mask_len: str, cache_len: str, out_len: str,
                           out_names) -> GraphSpec:
    """The causal_lm interface of one KV layout: the cache inputs are [batch, kv_heads, cache_len, head_dim],
    the mask [batch, 1, q_len, mask_len], the K/V outputs ``out_names`` [batch, kv_heads, out_len, head_dim]
    (growing: the whole present cache; capacity: only the new positions)."""
    kv_in = (BATCH, dims.num_kv_heads, cache_len, dims.head_dim)
    kv_out = (BATCH, dims.num_kv_heads, out_len, dims.head_dim)
    inputs = [
        TensorSpec("input_ids", "int64", (BATCH, Q_LEN)),
        TensorSpec("position_ids", "int64", (BATCH, Q_LEN)),
        TensorSpec("attention_mask", "bool", (BATCH, 1, Q_LEN, mask_len)),
    ]
    for k, v in past_names(dims.num_layers):
        inputs += [TensorSpec(k, "float32", kv_in), TensorSpec(v, "float32", kv_in)]
    outputs = [TensorSpec("logits", "float32", (BATCH, Q_LEN, dims.vocab_size))]
    if dims.feature_layers:
        outputs.append(
            TensorSpec("features", "float32", (BATCH, Q_LEN, len(dims.feature_layers) * dims.hidden_size))
        )
    for k, v in out_names:
        outputs += [TensorSpec(k, "float32", kv_out), TensorSpec(v, "float32", kv_out)]
    return GraphSpec("causal_lm", layout, tuple(inputs), tuple(outputs), dims)


NEW_LEN, CTX_LEN, MASK_LEN = "new_len", "ctx_len", "mask_len"
# Not a dynamic axis: the DSpark drafter's block size γ, a fixed int of each dspark_draft graph (the second axis of
# its block_positions input), named here so the derived-axis sums below can use it (:func:`graph_constants`).
BLOCK = "block"

# Axes whose size is the sum of other axes, in an order where every term is a base axis, a graph constant
# (:func:`graph_constants`) or a derived axis listed before it. TensorRT profiles (min/opt/max of each input) and
# runtime buffer sizes derive them with :func:`resolve_axes`, from this one declaration.
DERIVED_AXES = {
    TOTAL_LEN: (PAST_LEN, Q_LEN),    # growing decoder: the mask and present K/V
    KV_LEN: (CAPACITY, Q_LEN),       # capacity decoder: the mask
    CTX_LEN: (PAST_LEN, NEW_LEN),    # DSpark drafter: present context K/V = past + newly committed positions
    MASK_LEN: (CTX_LEN, BLOCK),      # DSpark drafter: the block attends to the context and to itself
}


def graph_constants(spec: "GraphSpec") -> dict:
    """Fixed sizes of ``spec`` that derived axes add: ``{BLOCK: γ}`` for a dspark_draft graph (the second axis of its
    ``block_positions`` input), ``{}`` for a decoder. Raises ValueError for a dspark_draft graph without
    ``block_positions`` or with a dynamic block axis (a declaration this code does not know)."""
    if spec.kind != "dspark_draft":
        return {}
    blk = next((t.shape[1] for t in spec.inputs if t.name == "block_positions"), None)
    if not isinstance(blk, int):
        raise ValueError(f"dspark_draft graph declares block_positions {blk!r}; expected [batch, γ] with a fixed γ")
    return {BLOCK: blk}


def resolve_axes(spec: "GraphSpec", sizes: dict) -> dict:
    """``sizes`` (base axis name -> int, or a tuple of ints such as a profile's (min, opt, max)) plus ``spec``'s
    constants and every :data:`DERIVED_AXES` entry whose terms are known, summed element-wise. Returns a new dict;
    axes with an unknown term are left out (the caller names the missing axis when a tensor needs it)."""
    out = dict(sizes)
    for name, value in graph_constants(spec).items():
        out.setdefault(name, value)
    for axis, parts in DERIVED_AXES.items():
        if axis in out or not all(p in out for p in parts):
            continue
        vals = [out[p] for p in parts]
        n = max((len(v) for v in vals if isinstance(v, tuple)), default=0)
        if n:
            out[axis] = tuple(sum(v[i] if isinstance(v, tuple) else v for v in vals) for i in range(n))
        else:
            out[axis] = sum(vals)
    return out


def tensor_shape(t: TensorSpec, sizes: dict) -> tuple:
    """``t``'s shape with every named axis taken from ``sizes`` (ints; see :func:`resolve_axes`). Raises KeyError
    naming the axis when ``sizes`` lacks one."""
    try:
        return tuple(ax if isinstance(ax, int) else int(sizes[ax]) for ax in t.shape)
    except KeyError as e:
        raise KeyError(f"tensor {t.name} has axis {e.args[0]!r} that no size was given for") from None


def dspark_draft_spec(dims: DecoderDims, feature_size: int, block_size: int) -> GraphSpec:
    """Declare the DSpark drafter graph ("dspark_draft", growing context-KV layout).

    One call per round does both drafter stages that need weights (docs/design.md section 1 step 1):

    inputs
      features          float32 [batch, new_len, m * hidden_target]  target features of newly committed positions
      feature_positions int64   [batch, new_len]                     their positions
      anchor_embeds     float32 [batch, 1, hidden]                   the anchor's (last committed token's) raw
                                                                     embedding row (the graph holds no [V, d]
                                                                     table; the mask token's row is a constant)
      block_positions   int64   [batch, block]                       anchor_pos .. anchor_pos + block - 1
      attention_mask    bool    [batch, 1, block, mask_len]          mask_len = past_len + new_len + block
      past.{i}.key/value float32 [batch, kv_heads, past_len, head_dim]  projected context K/V per draft layer
    outputs
      hidden            float32 [batch, block, hidden]   normed block hidden states h_1..h_γ
      base_logits       float32 [batch, block, vocab]    U_k = lm_head(h_k) over the draft vocabulary
      present.{i}.key/value float32 [batch, kv_heads, ctx_len, head_dim]  ctx_len = past_len + new_len

    ``dims.vocab_size`` is the drafter's output vocabulary (reduced or the target's); the Markov and
    confidence heads run outside the graph (numpy, ``dspark_runtime.drafting.dspark``).
    """
    kv_past = (BATCH, dims.num_kv_heads, PAST_LEN, dims.head_dim)
    kv_ctx = (BATCH, dims.num_kv_heads, CTX_LEN, dims.head_dim)
    inputs = [
        TensorSpec("features", "float32", (BATCH, NEW_LEN, feature_size)),
        TensorSpec("feature_positions", "int64", (BATCH, NEW_LEN)),
        TensorSpec("anchor_embeds", "float32", (BATCH, 1, dims.hidden_size)),
        TensorSpec("block_positions", "int64", (BATCH, block_size)),
        TensorSpec("attention_mask", "bool", (BATCH, 1, block_size, MASK_LEN)),
    ]
    for k, v in past_names(dims.num_layers):
        inputs += [TensorSpec(k, "float32", kv_past), TensorSpec(v, "float32", kv_past)]
    outputs = [TensorSpec("hidden", "float32", (BATCH, block_size, dims.hidden_size)),
               TensorSpec("base_logits", "float32", (BATCH, block_size, dims.vocab_size))]
    for k, v in present_names(dims.num_layers):
        outputs += [TensorSpec(k, "float32", kv_ctx), TensorSpec(v, "float32", kv_ctx)]
    return GraphSpec("dspark_draft", KV_LAYOUT_GROWING, tuple(inputs), tuple(outputs), dims)


LOGITS_AT = "logits_at"  # the EAGLE-3 draft step's input: per row, the query position its logits come from


def eagle3_draft_spec(dims: DecoderDims, feature_size: int) -> GraphSpec:
    """Declare the EAGLE-3 drafter graph ("eagle3_draft", growing KV layout): one draft step of a single decoder
    layer over its own KV cache (docs/drafter.md, "EAGLE-3").

    Each query position's input state is ``fc(features) + states``: the fused target features of a committed
    position (``states`` zero) or the drafter's own previous output state (``features`` zero; ``fc`` has no bias, so
    the zero term adds exactly nothing). A round is one call over the newly committed positions, then one call per
    further draft token on a one-position query.

    inputs
      features        float32 [batch, q_len, m * hidden_target]  the target's features at the drafter's layers
      states          float32 [batch, q_len, hidden]             draft states fed back
      embeds          float32 [batch, q_len, hidden]             embedding rows of the token *after* each position
                                                                 (the graph holds no [V, d] table)
      position_ids    int64   [batch, q_len]                     RoPE positions
      attention_mask  bool    [batch, 1, q_len, past_len + q_len]  True = may attend
      logits_at       int64   [batch]                            the query position each row's logits come from
      past.{i}.key/value float32 [batch, kv_heads, past_len, head_dim]
    outputs
      states_out      float32 [batch, q_len, hidden]   the layer's output states (fed back; not normed)
      logits          float32 [batch, vocab]           lm_head(norm(states_out[b, logits_at[b]]))
      present.{i}.key/value float32 [batch, kv_heads, past_len + q_len, head_dim]
    """
    kv_past = (BATCH, dims.num_kv_heads, PAST_LEN, dims.head_dim)
    kv_total = (BATCH, dims.num_kv_heads, TOTAL_LEN, dims.head_dim)
    inputs = [
        TensorSpec("features", "float32", (BATCH, Q_LEN, feature_size)),
        TensorSpec("states", "float32", (BATCH, Q_LEN, dims.hidden_size)),
        TensorSpec("embeds", "float32", (BATCH, Q_LEN, dims.hidden_size)),
        TensorSpec("position_ids", "int64", (BATCH, Q_LEN)),
        TensorSpec("attention_mask", "bool", (BATCH, 1, Q_LEN, TOTAL_LEN)),
        TensorSpec(LOGITS_AT, "int64", (BATCH,)),
    ]
    for k, v in past_names(dims.num_layers):
        inputs += [TensorSpec(k, "float32", kv_past), TensorSpec(v, "float32", kv_past)]
    outputs = [TensorSpec("states_out", "float32", (BATCH, Q_LEN, dims.hidden_size)),
               TensorSpec("logits", "float32", (BATCH, dims.vocab_size))]
    for k, v in present_names(dims.num_layers):
        outputs += [TensorSpec(k, "float32", kv_total), TensorSpec(v, "float32", kv_total)]
    return GraphSpec("eagle3_draft", KV_LAYOUT_GROWING, tuple(inputs), tuple(outputs), dims)
