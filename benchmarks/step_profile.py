"""Where one decoder step spends its time: ONNX Runtime's per-node profile of an engine graph, grouped.

For each cached length in --past and step size in --q: the LM head, weight MatMuls, attention, the growing-KV
``Concat`` copies and the rest by op type (medians over --repeats, ms per step; the wall time from an unprofiled
session). ``--against OTHER_ENGINE``: no profile, the unprofiled steps of both engines timed alternately in one
process (a before/after of two builds), once per rotation of the order the engines are loaded in (each rotation its
own process; ``--load-orders given``: the given order only), each engine's figure the geometric mean over the
rotations: the session loaded first steps slower (measured: docs/precision.md, "What a step is made of").
``--role dspark``: the DSpark drafter's drafting pass. Writes --json.

    python -m benchmarks.step_profile --engine engines/qwen2.5-coder-1.5b-int4 --past 256,1024,2048 --q 1,2,8
    python -m benchmarks.step_profile --engine engines/old --against engines/new --past 256,1024,2048 --q 1,2,4 --repeats 9
    python -m benchmarks.step_profile --engine E --against E::target_prompt --against E::openvino --past 0 --q 128,512 --last-logits
    python -m benchmarks.step_profile --engine E --against E::small-pages --past 256 --q 1,2,4,8
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.evalsets import ROOT, child_env
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.kernels import register_kernels
from dspark_runtime.machine.huge_pages import HugePagesForNewMemory
from dspark_runtime.machine.sysinfo import machine_description

SMALL_PAGES = "small-pages"  # --against DIR::small-pages: the weights left on base pages
ATTENTION_OPS = {"Softmax", "Where", "Not", "Expand", "Equal", "Less", "LessOrEqual", "And", "Or", "Cast",
                 "Trilu", "IsInf", "IsNaN"}


def weight_inputs(graph_path: Path, vocab: int) -> tuple:
    """(names of MatMul nodes with a weight initializer, name of the LM head node or None: the one traced from
    ``lm_head``, else the weight MatMul with ``vocab`` outputs)."""
    import onnx

    from dspark_export.graphs.onnx_io import module_name

    proto = onnx.load(str(graph_path), load_external_data=False)
    inits = {t.name: t for t in proto.graph.initializer}
    weighted, head = set(), None
    for n in proto.graph.node:
        if n.op_type in ("MatMul", "MatMulNBits", "MatMulGGUF", "MatMulInteger", "MatMulIntegerToFloat") and \
                any(i in inits for i in n.input[1:2]):
            weighted.add(n.name)
            w = inits[n.input[1]]
            n_out = next((a.i for a in n.attribute if a.name == "N"), w.dims[-1] if w.dims else 0)
            if module_name(n) == "lm_head" or "lm_head" in n.name or (head is None and n_out == vocab):
                head = n.name
    return weighted, head


def category(ev: dict, weighted: set, head: str | None) -> str:
    op, name = ev["args"].get("op_name", "?"), ev["name"].rsplit("_kernel_time", 1)[0]
    if head and (name == head or name.startswith(head)):
        return "lm_head"
    if op in ("MatMulNBits", "MatMulGGUF") or name in weighted:
        return "weight matmul"
    if op in ("MatMul", "FusedMatMul"):
        return "attention matmul"
    if op in ATTENTION_OPS:
        return "attention/mask other"
    if op == "Concat":
        return "Concat (KV copies)"
    return op


def step_call(session, spec):
    """A function of ``feeds`` that makes one step as the runtime does: a scatter graph with slot outputs writes its
    slot buffers in place on one kept binding and returns its logits (and features) only
    (dspark_runtime.backends.slot_binding.SlotBinding); any other graph computes every declared output."""
    from dspark_runtime.backends.slot_binding import SlotBinding
    from dspark_runtime.engine_dir.graphspec import slot_call_outputs

    slots, outs = _returned(spec)
    if not slots:
        return lambda feeds: session.run(outs, feeds)
    return SlotBinding(session, slots, slot_call_outputs(spec)).run


@functools.lru_cache(maxsize=None)
def _returned(spec) -> tuple:
    """(the graph's slot bindings, the outputs a call returns), once per spec (not inside a timed call)."""
    from dspark_runtime.engine_dir.graphspec import slot_bindings

    slots = slot_bindings(spec)
    return slots, [n for n in spec.output_names if n not in set(slots.values())]


def unprofiled_wall_ms(graph: Path, spec, feeds: dict, repeats: int, threads: int) -> float:
    """Median wall time of one step on a session set up as the runtime's (dspark_runtime.backends.ort.OrtDecoder)."""
    from dspark_runtime.backends.ort import OrtDecoder

    dec = OrtDecoder(graph, spec, threads=threads, precision="any").activate()
    call = step_call(dec.session, spec)
    call(feeds)
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        call(feeds)
        walls.append(time.perf_counter() - t)
    dec.deactivate()
    return statistics.median(walls) * 1000


def profile(graph: Path, spec, past: int, q: int, repeats: int, threads: int, weighted, head,
            last_logits: bool = False, padding_rows: int = 0) -> dict:
    """ONNX Runtime's per-node profile of one step (``past`` cached positions, ``q`` new ones; ``last_logits`` and
    ``padding_rows`` as in :func:`_feeds`), grouped by :func:`category`: the median ms per group over ``repeats``
    runs, and the step's unprofiled median wall time on a session set up as the runtime's."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"dspark_step_{past}_{q}")
    if spec.kernels:  # a graph on DSpark's own kernels (MatMulGGUF): the library shipped beside it
        register_kernels(so, graph.parent / spec.kernels)
    with HugePagesForNewMemory():  # as the runtime's sessions (dspark_runtime.backends.ort.OrtDecoder)
        sess = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
    feeds = _feeds(spec, past, q, last_logits=last_logits, padding_rows=padding_rows)
    call = step_call(sess, spec)
    call(feeds)  # warm-up (not counted: the profile is cut at the first timed run below)
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        call(feeds)
        walls.append(time.perf_counter() - t)
    trace_file = Path(sess.end_profiling())
    trace = json.loads(trace_file.read_text())
    trace_file.unlink()
    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    per_run = []
    for r in runs[1:]:  # the first model_run is the warm-up
        lo, hi = r["ts"], r["ts"] + r["dur"]
        cats: dict = {}
        for e in trace:
            if e.get("cat") == "Node" and lo <= e["ts"] <= hi and e["name"].endswith("_kernel_time"):
                c = category(e, weighted, head)
                cats[c] = cats.get(c, 0.0) + e["dur"] / 1000.0
        per_run.append(cats)
    keys = sorted({k for c in per_run for k in c})
    med = {k: statistics.median(c.get(k, 0.0) for c in per_run) for k in keys}
    wall = statistics.median(walls) * 1000
    del sess
    nodes = sum(med.values())
    return {"past": past, "q": q, "wall_ms": round(unprofiled_wall_ms(graph, spec, feeds, repeats, threads), 2),
            "profiled_wall_ms": round(wall, 2), "profiled_nodes_ms": round(nodes, 2),
            "by_category_ms": {k: round(v, 2) for k, v in sorted(med.items(), key=lambda kv: -kv[1])},
            "by_category_share": {k: round(v / nodes, 3) for k, v in sorted(med.items(), key=lambda kv: -kv[1])}}


def _draft_feeds(spec, past: int, q: int, rng) -> dict:
    """Random inputs of one DSpark drafting pass (``dspark_draft``): q new target features after ``past`` context
    positions, then the block."""
    from dspark_runtime.engine_dir.graphspec import past_names

    d = spec.dims
    ins = {t.name: t for t in spec.inputs}
    g = ins["block_positions"].shape[1]
    feeds = {"features": rng.standard_normal((1, q, ins["features"].shape[-1])).astype(np.float32),
             "feature_positions": np.arange(past, past + q, dtype=np.int64)[None],
             "block_positions": np.arange(past + q, past + q + g, dtype=np.int64)[None],
             "attention_mask": np.ones((1, 1, g, past + q + g), bool)}
    if "anchor_embeds" in ins:
        feeds["anchor_embeds"] = rng.standard_normal((1, 1, d.hidden_size)).astype(np.float32) * 0.02
    else:
        feeds["anchor_ids"] = rng.integers(0, 1000, (1, 1)).astype(np.int64)
    for kn, vn in past_names(d.num_layers):
        for n in (kn, vn):
            feeds[n] = rng.standard_normal((1, d.num_kv_heads, past, d.head_dim)).astype(np.float32) * 0.1
    return feeds


def _feeds(spec, past: int, q: int, seed: int = 0, last_logits: bool = False, padding_rows: int = 0) -> dict:
    """Random inputs of one step: q new tokens after ``past`` cached positions (values do not change the cost).
    Scatter-layout graphs get slot buffers as the runtime sizes them (dspark_runtime.runners.scatter: past + q rounded up to
    SLOT_STEP slots, the rest masked); a graph with ``logits_from`` gets 0 (every position's logits, a verify pass)
    or, with ``last_logits``, q - 1 (a prompt chunk: its last position's); a graph with ``logits_to`` gets
    q - ``padding_rows`` (a call whose last positions are row padding, its LM head on the real ones: the runtime's
    ``head_skips_padding``), at least 1."""
    from dspark_runtime.engine_dir.graphspec import LOGITS_FROM, LOGITS_TO, past_names
    from dspark_runtime.runners.scatter import SLOT_STEP

    d = spec.dims
    rng = np.random.default_rng(seed)
    if spec.kind == "dspark_draft":
        return _draft_feeds(spec, past, q, rng)
    cache = past
    mask = np.tril(np.ones((q, past + q), bool), k=past)
    if spec.kv_layout == "scatter":
        cache = -(-(past + q) // SLOT_STEP) * SLOT_STEP
        mask = np.tril(np.ones((q, cache), bool), k=past)
    feeds = {"input_ids": rng.integers(0, d.vocab_size, (1, q)).astype(np.int64),
             "position_ids": np.arange(past, past + q, dtype=np.int64)[None],
             "attention_mask": mask[None, None]}
    for kn, vn in past_names(d.num_layers):
        for n in (kn, vn):
            feeds[n] = rng.standard_normal((1, d.num_kv_heads, cache, d.head_dim)).astype(np.float32) * 0.1
    if LOGITS_FROM in spec.input_names:
        feeds[LOGITS_FROM] = np.array([q - 1 if last_logits else 0], np.int64)
    if LOGITS_TO in spec.input_names:
        feeds[LOGITS_TO] = np.array([q if last_logits else max(1, q - padding_rows)], np.int64)
    return feeds


def against(engines: list, role: str, pasts: list, qs: list, repeats: int, threads: int,
            last_logits: bool = False, padding_rows: int = 0) -> list:
    """Median unprofiled step (ms) of each engine's ``role`` graph per (past, q), engines timed alternately in one
    process on the shared thread pool (the CLI's setting). An engine given as ``DIR::KEY`` times its graph ``KEY``
    instead (``DIR::target_prompt``: its prompt graph), as ``DIR::openvino`` its ``role`` graph on ONNX Runtime's
    OpenVINO provider (``--prompts openvino``), as ``DIR::small-pages`` its ``role`` graph with the weights left on
    the base pages (``OrtDecoder(huge_pages=False)``; dspark_runtime.machine.huge_pages). Returns rows {past, q, ms:
    [ms per engine, in order]}."""
    from dspark_runtime.backends.ort import OrtDecoder, enable_shared_thread_pool
    from dspark_runtime.backends.ort_openvino import OrtOpenVinoDecoder

    enable_shared_thread_pool(threads)
    decs = {}
    for i, e in enumerate(engines):
        path, _, how = str(e).partition("::")
        e = Path(path)
        g = load_manifest(e, verify=False).graphs[role if how in ("", "openvino", SMALL_PAGES) else how]
        dec = (OrtOpenVinoDecoder(e / g.model_file, g.spec, threads=threads) if how == "openvino"
               else OrtDecoder(e / g.model_file, g.spec, threads=threads, precision="any",
                               huge_pages=how != SMALL_PAGES))
        dec.activate()
        decs[i] = (step_call(dec.session, g.spec), g.spec)
    rows = []
    for past in pasts:
        for q in qs:
            feeds = {k: _feeds(spec, past, q, last_logits=last_logits, padding_rows=padding_rows)
                     for k, (_, spec) in decs.items()}
            walls = {k: [] for k in decs}
            for k, (call, _) in decs.items():
                call(feeds[k])  # warm-up
            for _ in range(repeats):
                for k, (call, _) in decs.items():
                    t = time.perf_counter()
                    call(feeds[k])
                    walls[k].append(time.perf_counter() - t)
            rows.append({"past": past, "q": q, "ms": [round(statistics.median(walls[k]) * 1000, 2) for k in decs]})
    return rows


def combine_load_orders(runs: list) -> list:
    """Rows of :func:`against` from one run per load order -> one row per (past, q) with ``ms`` the geometric mean of
    each engine's median over the runs and ``ms_by_load_order`` the runs' own. ``runs``: [(order, rows)], ``order``
    the engines' indices in the order that run loaded them, each row's ``ms`` in that order. Pure function."""
    out = []
    for i, row in enumerate(runs[0][1]):
        per = []
        for order, rows in runs:
            r = rows[i]
            if (r["past"], r["q"]) != (row["past"], row["q"]):
                raise ValueError("the runs of the load orders measured different (past, q) rows")
            ms = [0.0] * len(order)
            for pos, k in enumerate(order):
                ms[k] = r["ms"][pos]
            per.append(ms)
        geo = [round(float(np.exp(np.mean(np.log([p[k] for p in per])))), 2) for k in range(len(per[0]))]
        out.append({"past": row["past"], "q": row["q"], "ms": geo, "ms_by_load_order": per})
    return out


def against_rotations(engines: list, argv_rest: list) -> tuple:
    """Run the ``--against`` comparison once per rotation of ``engines``' load order, each in its own process
    (``--load-orders given``; the shared thread pool is process-wide), and combine them
    (:func:`combine_load_orders`). ``argv_rest``: the other command-line options. Returns (rows, orders); SystemExit
    naming the order when a run fails."""
    def absolute(e: str) -> str:  # the child runs in the repository root
        path, sep, how = str(e).partition("::")
        return str(Path(path).resolve()) + sep + how

    engines = [absolute(e) for e in engines]
    n = len(engines)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for shift in range(n):
            order = [(shift + i) % n for i in range(n)]
            out = Path(tmp) / f"order{shift}.json"
            cmd = [sys.executable, "-m", "benchmarks.step_profile", "--engine", str(engines[order[0]])]
            for k in order[1:]:
                cmd += ["--against", str(engines[k])]
            done = subprocess.run(cmd + argv_rest + ["--load-orders", "given", "--json", str(out)],
                                  stdout=subprocess.DEVNULL, cwd=str(ROOT), env=child_env())
            if done.returncode:  # the child printed its error above
                raise SystemExit(f"error: the run loading the engines in order {order} failed (exit {done.returncode})")
            runs.append((order, json.loads(out.read_text())["rows"]))
    return combine_load_orders(runs), [o for o, _ in runs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, type=Path)
    ap.add_argument("--role", default="target")
    ap.add_argument("--past", default="256,1024,2048")
    ap.add_argument("--q", default="1,2,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--against", action="append",
                    help="another engine (repeatable): interleaved wall-time comparison, no profile; DIR::KEY times "
                         "its graph KEY (DIR::target_prompt: the prompt graph), DIR::small-pages the --role graph "
                         "with its weights on base pages (no huge pages), DIR::openvino the --role graph on "
                         "ONNX Runtime's OpenVINO provider")
    ap.add_argument("--last-logits", action="store_true",
                    help="time prompt-chunk calls: graphs with the logits_from input compute the last position's "
                         "logits only (others, exported before it, every position's)")
    ap.add_argument("--padding-rows", type=int, default=0,
                    help="time calls whose last N positions are row padding: graphs with the logits_to input run "
                         "the LM head on the others only (the runtime's head_skips_padding; others on every position)")
    ap.add_argument("--load-orders", choices=("rotate", "given"), default="rotate",
                    help="--against: time the engines once per rotation of their load order, each in its own "
                         "process, and report each engine's geometric mean (rotate, the default: the session "
                         "loaded first steps slower), or in the given order only")
    a = ap.parse_args(argv)
    if a.padding_rows < 0:
        ap.error("--padding-rows must be >= 0")
    if a.against:
        engines = [str(a.engine)] + a.against
        missing = [e for e in engines if not (Path(str(e).partition("::")[0]) / "manifest.json").is_file()]
        if missing:
            ap.error(f"not an engine directory (no manifest.json): {', '.join(missing)}; build one with "
                     "`dspark-export build`")
        orders = None
        if a.load_orders == "rotate":
            rest = ["--role", a.role, "--past", a.past, "--q", a.q, "--repeats", str(a.repeats), "--threads",
                    str(a.threads), "--padding-rows", str(a.padding_rows)] + (["--last-logits"] if a.last_logits else [])
            rows, orders = against_rotations(engines, rest)
        else:
            rows = against(engines, a.role, [int(x) for x in a.past.split(",")],
                           [int(x) for x in a.q.split(",")], a.repeats, a.threads, a.last_logits, a.padding_rows)
        if orders:
            print(f"each engine's median step, geometric mean over {len(orders)} load orders")
        print(f"{'past':>5s} {'q':>3s} " + " ".join(f"{e[-24:]:>24s}" for e in engines)
              + "  change vs the first")
        for r in rows:
            m0 = r["ms"][0]
            print(f"{r['past']:5d} {r['q']:3d} " + " ".join(f"{m:21.1f} ms" for m in r["ms"]) + "  "
                  + " ".join(f"{m / m0 - 1:+.0%}" for m in r["ms"][1:]), flush=True)
        out = {"engines": engines, "role": a.role, "machine": machine_description(),
               "threads": a.threads, "repeats": a.repeats, "load_orders": orders or [list(range(len(engines)))],
               "rows": rows}
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(out, indent=1) + "\n")
        return 0
    m = load_manifest(a.engine, verify=False)
    g = m.graphs.get(a.role)
    if g is None or g.spec.kind != "causal_lm":
        ap.error(f"{a.engine} has no decoder graph {a.role!r}")
    graph = a.engine / g.model_file
    weighted, head = weight_inputs(graph, g.spec.dims.vocab_size)
    rows = []
    for past in (int(x) for x in a.past.split(",")):
        for q in (int(x) for x in a.q.split(",")):
            r = profile(graph, g.spec, past, q, a.repeats, a.threads, weighted, head, a.last_logits, a.padding_rows)
            rows.append(r)
            top = ", ".join(f"{k} {v:.0%}" for k, v in list(r["by_category_share"].items())[:7])
            print(f"past {past:5d} q {q:3d}: {r['wall_ms']:7.1f} ms/step (profiled {r['profiled_wall_ms']:.1f}) | "
                  f"{top}", flush=True)
    out = {"engine": str(a.engine), "role": a.role, "precision": g.precision, "machine": machine_description(),
           "threads": a.threads, "repeats": a.repeats, "rows": rows}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
