"""Row-count invariance of the verifier: the condition under which speculative greedy output is *bitwise* the
target's, and :func:`probe_row_multiple`, which finds the padding that gives it on this machine.

ONNX Runtime's CPU kernels may compute a row differently depending on how many rows its call has, so target-only
decoding (one row per call) and a verify block (1 + ℓ rows) can disagree. Padding every target call to a multiple of
``row_multiple`` rows, the extra rows repeating the last token *after* the real ones (causal masking hides them;
their logits and K/V are dropped), gives every real row the same kernel path; the probe checks calls of 1-17 rows
(:data:`PROBE_BLOCKS`). The multiple belongs to the deployment machine's kernels: ``dspark-export profile`` probes it
and stores it in the manifest (``speculation.row_invariance``), and every runner pads by it. Covered: a request alone
on every KV layout, and in a batch on the scatter layout (not the packed one). Figures: docs/precision.md.
"""
from __future__ import annotations

import numpy as np

from dspark_runtime.backends.ort import session_options
from dspark_runtime.errors import DSparkError
from dspark_runtime.runners.scatter import ScatterRunner

#: multiples tried by :func:`probe_row_multiple`, smallest first
CANDIDATES = (1, 2, 4, 8)
#: real rows per call that each candidate must make equivalent: 1 = target-only decoding, 2..17 = verify blocks
#: of draft length 1..16 (the router's longest n-gram block; a DSpark block of 7 verifies 8 rows), so every
#: candidate is compared across several padded sizes (m = 8: 8, 16 and 24 rows)
PROBE_BLOCKS = tuple(range(1, 18))


def padded_rows(q: int, multiple: int) -> int:
    """The number of rows a call of ``q`` real rows is padded to: the smallest multiple of ``multiple``
    that is >= q. Raises ValueError for q < 1 or multiple < 1."""
    if q < 1 or multiple < 1:
        raise ValueError(f"need q >= 1 and multiple >= 1, got q={q}, multiple={multiple}")
    return -(-q // multiple) * multiple


def teacher_force(runner, prompt: list, cont: list, block: int) -> tuple:
    """Prefill ``prompt``, then feed ``cont`` in calls of ``block`` real tokens through ``runner`` (a
    :class:`~dspark_runtime.runners.sequence.DecoderRunner`, with whatever ``row_multiple`` it has).

    Returns (logits float32 [len(cont), vocab], per-layer (key, value) float32 copies of the final cache
    [1, kv_heads, len(prompt) + len(cont), head_dim])."""
    runner.reset()
    runner.prefill(prompt)
    out = [np.array(runner.step(cont[s:s + block])) for s in range(0, len(cont), block)]
    kv = [(np.array(k), np.array(v)) for k, v in runner.cache.view()]
    return np.concatenate(out, axis=0), kv


def max_difference(a: tuple, b: tuple) -> float:
    """Max |difference| over the logits and every layer's keys and values of two :func:`teacher_force`
    results (0.0 = bitwise identical, NaN-aware: a NaN anywhere counts as a difference)."""
    (la, kva), (lb, kvb) = a, b
    d = [np.abs(la - lb).max()] + [np.abs(x - y).max() for (k0, v0), (k1, v1) in zip(kva, kvb)
                                   for x, y in ((k0, k1), (v0, v1))]
    d = np.asarray(d, dtype=np.float64)
    return float("inf") if np.isnan(d).any() else float(d.max())


def kernel_probe_session(threads: int, *, hidden: int = 1536, heads: int = 2, head_dim: int = 128, keys: int = 300,
                         seed: int = 0):
    """An ONNX Runtime CPU session of the float kernels a decoder step runs per row — a weight MatMul
    (X [1, M, hidden] @ W [hidden, hidden]) and attention (softmax(Q [1, heads, M, head_dim] @ K^T
    [1, heads, head_dim, keys]) @ V [1, heads, keys, head_dim]) — built in memory with ``onnx`` (the export
    extra; ImportError otherwise). Used by :func:`kernel_row_difference`: unlike a quantized graph, whose
    activation rounding hides row-count differences until one crosses a rounding boundary (rare), these
    fp32 outputs show every one. Returns the session; its inputs are ``x`` float32 [1, M, hidden] and ``q``
    float32 [1, heads, M, head_dim], its outputs ``y`` and ``o``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    k = rng.standard_normal((1, heads, head_dim, keys)).astype(np.float32)
    v = rng.standard_normal((1, heads, keys, head_dim)).astype(np.float32)
    f = TensorProto.FLOAT
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]),
         helper.make_node("MatMul", ["q", "k"], ["s"]),
         helper.make_node("Softmax", ["s"], ["p"], axis=-1),
         helper.make_node("MatMul", ["p", "v"], ["o"])],
        "row_probe",
        [helper.make_tensor_value_info("x", f, [1, "m", hidden]),
         helper.make_tensor_value_info("q", f, [1, heads, "m", head_dim])],
        [helper.make_tensor_value_info("y", f, [1, "m", hidden]),
         helper.make_tensor_value_info("o", f, [1, heads, "m", head_dim])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(k, "k"), numpy_helper.from_array(v, "v")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])


def kernel_row_difference(multiple: int, threads: int, *, rows: int = 24, blocks=PROBE_BLOCKS, seed: int = 1,
                          attention_rows: int = 1) -> float:
    """Max |difference| of the per-row results of :func:`kernel_probe_session`'s kernels when ``rows`` random
    rows are fed in calls of every size in ``blocks``, each call padded to a multiple of ``multiple`` rows
    (0.0 = the kernels are row-count invariant at that padding on this machine, with ``threads``).
    ``attention_rows``: rows the graph's attention MatMuls compute per query position
    (:func:`~dspark_runtime.engine_dir.graphspec.attention_rows_per_query`: its query heads per KV head stacked as
    rows), so a call of n positions multiplies ``attention_rows * n`` rows by the keys, as in the graph."""
    sess = kernel_probe_session(threads)
    rng = np.random.default_rng(seed)
    hidden = sess.get_inputs()[0].shape[-1]
    heads, head_dim = sess.get_inputs()[1].shape[1], sess.get_inputs()[1].shape[-1]
    g = int(attention_rows)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    q = rng.standard_normal((heads, rows, g, head_dim)).astype(np.float32)

    def run(block):
        ys, os_ = [], []
        for s in range(0, rows, block):
            n = min(block, rows - s)
            pad = padded_rows(n, multiple) - n
            xi = np.concatenate([x[s:s + n], np.repeat(x[s + n - 1:s + n], pad, axis=0)])
            qi = np.concatenate([q[:, s:s + n], np.repeat(q[:, s + n - 1:s + n], pad, axis=1)], axis=1)
            y, o = sess.run(["y", "o"], {"x": xi[None], "q": qi.reshape(heads, (n + pad) * g, head_dim)[None]})
            ys.append(y[0, :n])
            os_.append(o[0].reshape(heads, n + pad, g, head_dim)[:, :n])
        return np.concatenate(ys), np.concatenate(os_, axis=1)

    ref = run(blocks[0])
    worst = 0.0
    for b in blocks[1:]:
        y, o = run(b)
        worst = max(worst, float(np.abs(y - ref[0]).max()), float(np.abs(o - ref[1]).max()))
    return worst


def probe_row_multiple(runner, prompt: list, cont: list, *, candidates=CANDIDATES, blocks=PROBE_BLOCKS,
                       kernel_check=None) -> dict:
    """Find the smallest row multiple m (from ``candidates``) that makes ``runner``'s graph row-count
    invariant on this machine: ``cont`` teacher-forced after ``prompt`` in calls of every size in
    ``blocks``, each call padded to a multiple of m, gives bitwise-identical logits and KV cache. Where the runner
    ``can_skip_padding_head``, each m > 1 is tried first with the LM head on the real positions only
    (``head_skips_padding``: the head then runs on 1..max(blocks) rows, so it is kept only where the head is
    row-count invariant too), then on every padded position.

    Args:
        runner: a DecoderRunner (its ``row_multiple`` and ``head_skips_padding`` are restored afterwards).
        prompt, cont: token ids (list[int]); ``cont`` should hold >= max(blocks) tokens (a few dozen:
            differences can appear anywhere, the probe finds the usual kernel paths within ~16 tokens).
    Returns {"row_multiple": m or None when no candidate is invariant, "head_skips_padding": bool,
    "max_abs_difference": {str(m) (head on every row) or f"{m}:real-rows-head": float, largest difference from
    the block-1 run over all block sizes}, "blocks": list, "tokens": len(cont)}. Raises ValueError when ``cont`` is
    shorter than the largest block.
    """
    if len(cont) < max(blocks):
        raise ValueError(f"the probe needs at least {max(blocks)} continuation tokens, got {len(cont)}")
    saved = runner.row_multiple, runner.head_skips_padding
    diffs, kdiffs, found = {}, {}, None
    try:
        for m in candidates:
            if kernel_check is not None:
                kdiffs[str(m)] = float(kernel_check(m))
                if kdiffs[str(m)] != 0.0:
                    continue
            runner.row_multiple = m
            for skip in ((True, False) if m > 1 and runner.can_skip_padding_head else (False,)):
                runner.head_skips_padding = skip
                ref = teacher_force(runner, prompt, cont, blocks[0])
                worst = max(max_difference(ref, teacher_force(runner, prompt, cont, b)) for b in blocks[1:])
                diffs[f"{m}:real-rows-head" if skip else str(m)] = worst
                if worst == 0.0:
                    found = (m, skip)
                    break
            if found:
                break
    finally:
        runner.row_multiple, runner.head_skips_padding = saved
        runner.reset()
    m, skip = found or (None, False)
    res = {"row_multiple": m, "head_skips_padding": skip, "max_abs_difference": diffs, "blocks": list(blocks),
           "tokens": len(cont)}
    if kernel_check is not None:
        res["kernel_max_abs_difference"] = kdiffs
    return res


def probe_target_rows(runner, vocab_size: int, threads: int, *, prompt_tokens: int = 48, tokens: int = 24,
                      seed: int = 0, kernels: bool = True, attention_rows: int = 1) -> dict:
    """:func:`probe_row_multiple` on a target ``runner`` with ``tokens`` random ids (below min(vocab_size, 30000))
    after a random ``prompt_tokens``-token prompt; with ``kernels`` also the fp32 kernel probe
    (:func:`kernel_row_difference` on ``threads``, its attention at the graph's ``attention_rows`` per position),
    which needs ``onnx`` and catches the rare differences of quantized graphs — without onnx the result's "note"
    says it was skipped. Returns the probe's dict."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, min(vocab_size, 30000), size=prompt_tokens + tokens).tolist()
    check, note = None, None
    if kernels:  # the kernel probe runs ONNX Runtime's CPU kernels
        try:
            import onnx  # noqa: F401  (builds the probe graph; the export extra)

            check = lambda m: kernel_row_difference(m, threads, attention_rows=attention_rows)  # noqa: E731
        except ImportError:
            note = ("kernel probe skipped: the onnx package is not installed (pip install onnx); the graph probe "
                    "alone can miss the rare differences of quantized graphs")
    res = probe_row_multiple(runner, ids[:prompt_tokens], ids[prompt_tokens:], kernel_check=check)
    if note:
        res["note"] = note
    return res


#: the prompt the invariance check feeds, and the chunkings of it compared with one call of all of it: an even split,
#: a remainder shorter than ``min_query_rows``, a short first chunk
PROBE_TOKENS = 24
PROBE_CHUNKINGS = ((16, 8), (21, 3), (5, 19))


def check_prompt_chunks_invariant(target_backend, prompt_backend, row_multiple: int = 1) -> None:
    """Raise DSparkError unless ``prompt_backend`` computes a prompt's positions bit for bit alike however the prompt
    is chunked: :data:`PROBE_TOKENS` token ids of a fixed prompt in one call against each of
    :data:`PROBE_CHUNKINGS`, compared on every layer's keys and values and on the last position's logits, through a
    :class:`~dspark_runtime.runners.scatter.ScatterRunner` over ``target_backend`` (padding to ``row_multiple`` rows as
    the engine does) with ``prompt_backend`` set. (A backend whose calls hold one request each, as the OpenVINO one,
    never shares a call, so the batch needs no check.)"""
    vocab = target_backend.spec.dims.vocab_size
    ids = [int(i) for i in np.random.default_rng(7).integers(vocab // 8, vocab // 2, PROBE_TOKENS)]

    def prompt_in(chunks) -> tuple:
        r = ScatterRunner(target_backend, row_multiple=row_multiple)
        r.prompt_backend = prompt_backend
        r.add(0)
        at, last = 0, None
        for n in chunks:
            last = r.step([(0, ids[at:at + n])], last_only={0})[0]
            at += n
        return np.asarray(last[-1]), r.export_kv(0, 0, PROBE_TOKENS)[0]

    ref_logits, ref_kv = prompt_in([PROBE_TOKENS])
    for chunks in PROBE_CHUNKINGS:
        logits, kv = prompt_in(chunks)
        if not (np.array_equal(logits, ref_logits)
                and all(np.array_equal(a, b) for pa, pb in zip(kv, ref_kv) for a, b in zip(pa, pb))):
            raise DSparkError(f"{prompt_backend.path.name} on {prompt_backend.providers[0]} computes a "
                              f"{PROBE_TOKENS}-token prompt fed in chunks of {' + '.join(map(str, chunks))} tokens "
                              "differently from one call on this machine, so speculative output could differ from "
                              "target-only output; run prompt chunks on the target (--prompts target)")
