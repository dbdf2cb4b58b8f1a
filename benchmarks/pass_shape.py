"""What a batched verifier pass costs by its shape: R request rows x Q query tokens each, against the cost table.

Times the engine's batched target runner (the one ``Engine.batch`` drives) at each (R, Q) with ``--context`` cached
positions per row and prints measured / the table's ``t_verify(R x Q)``; median of ``--repeats`` after a warm-up,
ms, each pass rolled back. Writes --json. One process; run nothing else on the cores.

    python -m benchmarks.pass_shape --engine engines/qwen2.5-coder-1.5b --rows 1,2,4,8 --q 1,2,4,8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--rows", default="1,2,4,8", help="request rows per pass")
    ap.add_argument("--q", default="1,2,4,8", help="query tokens per row")
    ap.add_argument("--context", type=int, default=256, help="cached positions per row")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from dspark_runtime.scheduling.cost_table import cost_table_at
    from dspark_runtime.engine import Engine
    from benchmarks.evalsets import machine

    eng = Engine.load(a.engine)
    rows_list = [int(x) for x in a.rows.split(",")]
    qs = [int(x) for x in a.q.split(",")]
    table_all = eng.manifest.speculation.cost_table
    rng = np.random.default_rng(0)
    runner = eng.loop_runner("target", max_requests=max(rows_list))
    rids = list(range(max(rows_list)))
    for rid in rids:
        runner.add(rid)
        runner.prefill(rid, rng.integers(0, 30000, size=a.context).tolist())
    attended = runner.attended_positions(rids)
    table = cost_table_at(table_all, attended) if table_all else None
    results = []
    print(f"{machine()}; {a.engine}; {a.context} cached positions per row, {attended} attended; median of {a.repeats}")
    print("| rows R | tokens per row Q | pass tokens | measured ms | table t_verify(pass tokens) ms | measured / table |")
    print("|---|---|---|---|---|---|")
    for r in rows_list:
        for q in qs:
            segs = [(rid, rng.integers(0, 30000, size=q).tolist()) for rid in rids[:r]]
            n = runner.pass_rows([q] * r)
            times = []
            for i in range(a.repeats + 1):
                t0 = time.perf_counter()
                runner.step(segs)
                dt = time.perf_counter() - t0
                for rid in rids[:r]:
                    runner.rollback(rid, a.context)
                if i:
                    times.append(dt)
            med = statistics.median(times)
            pred = None
            if table is not None:
                from dspark_runtime.scheduling.draft_skip import verify_table

                pred = verify_table(table).round_seconds(n)
            results.append({"rows": r, "q": q, "pass_tokens": n, "measured_s": med, "table_s": pred})
            ratio = f"{med / pred:.2f}" if pred else "-"
            print(f"| {r} | {q} | {n} | {med * 1e3:.1f} | {pred * 1e3 if pred else float('nan'):.1f} | {ratio} |",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": machine(), "engine": a.engine, "context": a.context,
                                            "attended": attended, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
