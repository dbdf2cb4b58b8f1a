"""What a drafter must accept to pay on an engine: the acceptance each drafter graph needs for a given speedup over
target-only decoding, priced by the engine's profiled round costs and each graph's measured drafting pass.

The model (:mod:`dspark_runtime.scheduling.breakeven`) is one request, greedy, the verify length chosen per round as
Algorithm 1 does for one request: a round costs the drafting pass plus the target's pass over 1 + l tokens and
commits 1 + a_1 + ... + a_l tokens in expectation. Survivals are geometric, a_j = α^j (α: the acceptance of each
draft given the ones before it); a drafter graph's pass is the engine's profiled t_draft with the shipped graph's
time replaced by that graph's (``python -m benchmarks.step_profile --role dspark --against ...`` measures them side
by side; the runtime's work around the graph is kept). For each graph and speedup: the least α that reaches it,
its best verify length, and the τ at a fixed block of 7 that α gives (the drafter issue's "τ at γ=7"). ``--survival`` prices a measured survival profile too (e.g. ``mean true`` of
``dspark-export calibrate``).

    python -m benchmarks.drafter_breakeven --engine engines/qwen2.5-coder-1.5b --draft-costs step_profile.json \\
        --survival 0.507,0.276,0.151,0.078,0.043,0.024,0.015 --out results/drafter-breakeven-qwen2.5-coder-1.5b-zen5.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.scheduling.breakeven import drafting_seconds, needed_alpha, speedup, tau_fixed
from dspark_runtime.scheduling.cost_table import cost_table_at


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", type=Path, required=True, help="an engine with a cost table (dspark-export profile)")
    ap.add_argument("--draft-costs", type=Path, required=True,
                    help="step_profile --role dspark --against ... JSON: its first engine's drafter must be the one "
                         "the cost table profiled")
    ap.add_argument("--context", type=int, default=512, help="cached positions (one of the --draft-costs pasts)")
    ap.add_argument("--speedups", default="1.0,1.3,1.6")
    ap.add_argument("--survival", default=None, help="a measured survival profile a_1..a_γ to price, comma-separated")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    table = load_manifest(a.engine, verify=False).speculation.cost_table
    if not table or "t_verify" not in table:
        sys.exit(f"{a.engine} has no profiled cost table with t_verify: run `dspark-export profile {a.engine}`")
    costs = json.loads(a.draft_costs.read_text())
    row = next((r for r in costs.get("rows", []) if r["past"] == a.context and r["q"] == 1), None)
    if costs.get("role") != "dspark" or row is None:
        sys.exit(f"{a.draft_costs}: no --role dspark row at past {a.context}, q 1 (pasts: "
                 f"{sorted({r['past'] for r in costs.get('rows', [])})})")
    t_draft = drafting_seconds(table, a.context)
    around = t_draft - row["ms"][0] / 1e3  # the runtime's work around the graph, kept for every graph
    targets = [float(x) for x in a.speedups.split(",")]
    survival = [float(v) for v in a.survival.split(",")] if a.survival else None
    at_context = cost_table_at(table, a.context)
    out = {"engine": str(a.engine), "context": a.context, "machine": costs.get("machine"),
           "t_verify_ms": [round(1e3 * t, 2) for t in at_context["t_verify"]],
           "tokens": at_context["tokens"], "t_draft_profiled_ms": round(1e3 * t_draft, 2), "graphs": []}
    print(f"{a.engine}: t_verify(1) {out['t_verify_ms'][0]} ms, profiled drafting round {1e3 * t_draft:.2f} ms "
          f"(graph {row['ms'][0]} ms) at {a.context} cached positions")
    for eng, ms in zip(costs["engines"], row["ms"]):
        td = around + ms / 1e3
        g = {"engine": eng, "graph_ms": ms, "round_draft_ms": round(1e3 * td, 2), "needs": []}
        for s in targets:
            alpha = needed_alpha(table, s, a.context, td)
            g["needs"].append({"speedup": s, "alpha": None if alpha is None else round(alpha, 4),
                               "verify_length": None if alpha is None else speedup(
                                   table, alpha ** np.arange(1, 8), a.context, td)[0],
                               "tau_gamma7": None if alpha is None else round(tau_fixed(alpha), 2)})
        if survival:
            l, x = speedup(table, survival, a.context, td)
            g["at_survival"] = {"verify_length": l, "speedup": round(x, 3)}
        out["graphs"].append(g)
        need = "; ".join(f"{n['speedup']}x: " + ("unreachable" if n["alpha"] is None else
                         f"alpha {n['alpha']:.3f} (l={n['verify_length']}, tau@7 {n['tau_gamma7']})")
                         for n in g["needs"])
        at = f" | at the given survivals {g['at_survival']['speedup']:.3f}x (l={g['at_survival']['verify_length']})" \
            if survival else ""
        print(f"{eng}: graph {ms} ms, round {g['round_draft_ms']} ms | {need}{at}")
    if survival:
        out["survival"] = survival
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
