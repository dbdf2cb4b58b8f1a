"""What a DSpark join round costs the drafter: one padded call against the split of ``dspark.context_groups``.

Times the engine's ``dspark_draft`` graph on random features of the right shapes: a few call shapes, then a join
round of ``--rows`` decoding rows plus one ``--prompt``-token prompt, as one padded call and as the calls
:func:`dspark_runtime.drafting.dspark.context_groups` chooses. Best of ``--repeats``, ms. Findings: docs/results.md.

    python -m benchmarks.drafter_catchup --engine engines/qwen2.5-coder-1.5b
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="an engine directory with a DSpark drafter")
    ap.add_argument("--rows", type=int, default=7, help="decoding rows beside the joining prompt")
    ap.add_argument("--prompt", type=int, default=200, help="the joining prompt's new context positions")
    ap.add_argument("--cached", type=int, default=250, help="cached context positions per row")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    from dspark_runtime.drafting.dspark import context_groups
    from dspark_runtime.engine import Engine
    from dspark_runtime.errors import InputError

    eng = Engine.load(a.engine, threads=a.threads)
    if not eng.dspark_graph:
        raise SystemExit(InputError(f"{a.engine} has no DSpark drafter; add one with `dspark-export add-draft`"))
    graph = eng._backends[eng.dspark_graph]
    spec, gam = graph.spec, graph.block_size
    F, S = spec.inputs[0].shape[-1], a.cached
    rng = np.random.default_rng(0)

    def call(rows: int, n: int) -> float:
        kv = [(rng.standard_normal((rows, spec.dims.num_kv_heads, S, spec.dims.head_dim), dtype=np.float32),) * 2
              for _ in range(spec.dims.num_layers)]
        feats = rng.standard_normal((rows, n, F), dtype=np.float32)
        fpos = np.tile(np.arange(S, S + n), (rows, 1))
        bpos = np.tile(np.arange(S + n, S + n + gam), (rows, 1))
        anchors = np.full((rows, 1), 100, dtype=np.int64)
        mask = np.ones((rows, 1, gam, S + n + gam), dtype=bool)
        t = time.perf_counter()
        graph.run(feats, fpos, anchors, bpos, mask, kv)
        return time.perf_counter() - t

    def best(f) -> float:
        return 1e3 * min(f() for _ in range(a.repeats))

    call(1, 1)  # session warm-up
    R = a.rows + 1
    for rows, n in [(R, 1), (1, 1), (1, a.prompt), (R, a.prompt), (R, 64)]:
        print(f"{rows} rows x {n} new positions ({S} cached): {best(lambda: call(rows, n)):.1f} ms", flush=True)
    counts = [a.prompt] + [1] * a.rows
    groups = context_groups(counts, gam)
    one = best(lambda: call(R, a.prompt))
    split = best(lambda: sum(call(len(g), max(counts[i] for i in g)) for g in groups))
    print(f"join round, {a.rows} decoding rows + a {a.prompt}-token prompt: one call {one:.1f} ms; "
          f"split into {[len(g) for g in groups]} rows a call {split:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
