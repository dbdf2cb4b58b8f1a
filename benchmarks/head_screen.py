"""How coarse the screened LM head's screen may be: for each screen form (bits, block) fitted to an int4 engine's exact
8-bit head, whether the exact head's top token falls among the screen's best candidates, how far the sampled
distribution moves, and what one screen ``MatMulNBits`` costs.

Hidden states: the target graph's LM-head input at every position of teacher-forced sequences (a copy of the graph
whose ``logits`` output is that input, in a temporary folder; the engine is not modified). Sequences: ``--ids`` (an
``ids.json`` of ``benchmarks.int4_fidelity``'s ``--work``) or the first ``--n`` calibration-split prompts plus
``--continuation`` tokens of the engine's greedy output. Exact logits: the exact head's weights times the fp32 hidden
state (what the screened head rescores the candidates with). Per screen: bytes, relative L2 against the exact head,
the share of positions whose exact top token is among the best ``c`` screen scores for each ``--candidates`` c, the
worst rank, the mean total variation of the softmax against the exact logits with the best ``c`` rescored (every
``--tv-stride``-th position), and the kernel's ms at ``--rows`` (best of ``--repeats``, 2 threads) with a check that a
row's scores do not depend on the call's row count. Writes --json.

    python -m benchmarks.head_screen --engine engines/qwen2.5-coder-1.5b --ids $TMPDIR/fid/ids.json \\
        --screens 4:32,2:32,2:64,2:128 --json results/head-screen-qwen2.5-coder-1.5b.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.evalsets import machine
from benchmarks.int4_fidelity import graph_logits, make_sequences, softmax
from dspark_export.graphs.onnx_io import ExternalData, read_initializer, set_live_nodes
from dspark_export.precision.nbits import NBitsWeight, fit_uint_rows
from dspark_runtime.engine_dir.manifest import load_manifest


def exact_head(graph: Path):
    """(the LM head's input tensor name, its exact rows float32 [vocab, K]) of an int4 target graph: a screened head
    (the ``<head>_rows_*`` tensors its ``TopK`` candidates are gathered from) or a full ``MatMulNBits`` head."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    reader = ExternalData(graph.parent)
    prod = {o: n for n in proto.graph.node for o in n.output}
    topk = [n for n in proto.graph.node if n.op_type == "TopK" and n.name.endswith("_TopK")]
    if topk:
        b = topk[0].name[:-len("_TopK")]
        screen = prod[topk[0].input[0]]
        q = read_initializer(inits[b + "_rows_Q"], reader).astype(np.float32)
        s = read_initializer(inits[b + "_rows_scales"], reader)
        zp = (read_initializer(inits[b + "_rows_zp"], reader).astype(np.float32)[..., None] if b + "_rows_zp" in inits
              else float(read_initializer(inits[b + "_rows_zp_f"], reader)))
        rows = ((q - zp) * s[..., None]).reshape(q.shape[0], -1)
        hidden = screen.input[0]
    else:
        head = prod["logits"]
        if head.op_type != "MatMulNBits":
            raise SystemExit(f"error: {graph} has neither a screened nor a MatMulNBits LM head")
        arrays = {n: read_initializer(inits[n], reader) for n in head.input[1:] if n}
        rows = NBitsWeight.from_node(head, arrays.__getitem__).dequantize().T
        hidden = head.input[0]
    reader.close()
    return hidden, np.ascontiguousarray(rows, np.float32)


def hidden_engine(engine: Path, hidden: str, k: int, tmp: Path) -> Path:
    """A copy of ``engine``'s target (manifest, graph, weights linked or copied) in ``tmp`` whose ``logits`` output is
    the LM head's input ``hidden`` [batch, positions, K]; the head's nodes are dropped."""
    import onnx
    from onnx import helper

    m = load_manifest(engine, verify=False)
    name = m.graphs["target"].model_file
    proto = onnx.load(str(engine / name), load_external_data=False)
    g = proto.graph
    nodes = [n for n in g.node if "logits" not in n.output]
    nodes.append(helper.make_node("Identity", [hidden], ["logits"], name="head_input_as_logits"))
    set_live_nodes(g, nodes)  # the rest of the head no longer reaches an output
    out = next(o for o in g.output if o.name == "logits")
    out.type.tensor_type.shape.dim[-1].dim_value = k
    onnx.save_model(proto, str(tmp / name))
    for f in ("manifest.json", name + ".data"):
        try:
            os.link(engine / f, tmp / f)
        except OSError:
            shutil.copy(engine / f, tmp / f)
    return tmp


def kernel_ms(screen: NBitsWeight, x: np.ndarray, rows: list, repeats: int) -> tuple:
    """({rows: best ms}, row-invariant) of one 2-thread ``MatMulNBits`` (accuracy level 4) holding ``screen``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(screen.packed, "q"), numpy_helper.from_array(screen.scales.reshape(-1), "s"),
             numpy_helper.from_array(screen.packed_zero_points(), "zp")]
    node = helper.make_node("MatMulNBits", ["x", "q", "s", "zp"], ["y"], domain="com.microsoft", K=screen.k,
                            N=screen.n, bits=screen.bits, block_size=screen.block_size, accuracy_level=4)
    g = helper.make_graph([node], "screen", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", screen.k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", screen.n])], inits)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21),
                                                                    helper.make_opsetid("com.microsoft", 1)])
                                .SerializeToString(), so, providers=["CPUExecutionProvider"])
    one = sess.run(None, {"x": x[:1]})[0][0]
    invariant = all(np.array_equal(sess.run(None, {"x": x[:r]})[0][0], one) for r in rows if r > 1)
    ms = {}
    for r in rows:
        sess.run(None, {"x": x[:r]})
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            sess.run(None, {"x": x[:r]})
            best = min(best, time.perf_counter() - t)
        ms[r] = round(best * 1e3, 2)
    return ms, invariant


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True, help="an int4 engine with an 8-bit (screened or full) head")
    ap.add_argument("--ids", type=Path, help="ids.json of teacher-forced sequences (else --n calibration prompts)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--screens", default="4:32,2:32,2:64,2:128", help="bits:block, comma-separated")
    ap.add_argument("--candidates", default="16,32,64,128,256,512")
    ap.add_argument("--tv-stride", type=int, default=3)
    ap.add_argument("--rows", default="1,2,8,16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    graph = a.engine / load_manifest(a.engine, verify=False).graphs["target"].model_file
    hidden_name, w = exact_head(graph)
    if a.ids:
        seqs = json.loads(a.ids.read_text())
    else:
        a.split, a.work = "calibration", Path(tempfile.mkdtemp(prefix="dspark-head-screen-"))
        seqs = make_sequences(a.engine, a)
    with tempfile.TemporaryDirectory(prefix="dspark-head-screen-") as tmp:
        eng = hidden_engine(a.engine, hidden_name, w.shape[1], Path(tmp))
        graph_logits(eng, seqs, Path(tmp) / "hidden", a.threads)
        h = np.concatenate([np.load(Path(tmp) / "hidden" / f"{n}.npy").reshape(-1, w.shape[1]) for n in seqs])
    exact = h @ w.T
    top = exact.argmax(1)
    sub = slice(None, None, a.tv_stride)
    p_exact = softmax(exact[sub])
    counts = [int(c) for c in a.candidates.split(",")]
    rows = [int(r) for r in a.rows.split(",")]
    res = {}
    for form in a.screens.split(","):
        bits, block = (int(v) for v in form.split(":"))
        parts = [fit_uint_rows(w[i:i + 8192], block, bits=bits) for i in range(0, len(w), 8192)]
        wq = np.concatenate([p.dequantize().T for p in parts])
        scores = h @ wq.T
        rank = (scores > scores[np.arange(len(scores)), top][:, None]).sum(1)
        tv = {}
        for c in counts:
            cc = min(c, w.shape[0])  # more candidates than tokens: every token rescored
            idx = np.argpartition(-scores[sub], cc - 1, axis=1)[:, :cc]
            merged = scores[sub].copy()
            np.put_along_axis(merged, idx, np.take_along_axis(exact[sub], idx, 1), 1)
            tv[c] = round(float((0.5 * np.abs(softmax(merged) - p_exact).sum(-1)).mean()), 5)
        screen = NBitsWeight(bits, block, np.concatenate([p.packed for p in parts]),
                             np.concatenate([p.scales for p in parts]), np.concatenate([p.zero_points for p in parts]))
        ms, invariant = kernel_ms(screen, h[:max(rows)], rows, a.repeats)
        res[form] = {"bytes": int(screen.packed.nbytes + screen.scales.nbytes + screen.packed_zero_points().nbytes),
                     "rel_l2": round(float(np.linalg.norm(wq - w) / np.linalg.norm(w)), 4),
                     "top1_within": {c: round(float((rank < c).mean()), 5) for c in counts},
                     "worst_rank": int(rank.max()), "total_variation": tv, "kernel_ms": ms, "row_invariant": invariant}
        print(f"{form:7s} {res[form]['bytes'] / 1e6:6.0f} MB  rel L2 {res[form]['rel_l2']:.3f}  top-1 within "
              + " ".join(f"{c}:{v:.2%}" for c, v in res[form]["top1_within"].items())
              + f"  worst {rank.max()}  TV " + " ".join(f"{c}:{v:.4f}" for c, v in tv.items())
              + "  ms " + " ".join(f"{r}:{v}" for r, v in ms.items()) + f"  row-invariant {invariant}", flush=True)
    out = {"machine": machine(), "engine": str(a.engine), "positions": int(len(h)), "tv_positions": int(len(p_exact)),
           "screens": res, "command": shlex.join(["python", "-m", "benchmarks.head_screen", *sys.argv[1:]])}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
