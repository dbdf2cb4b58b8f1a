"""``python -m benchmarks.soak``: every phase against one ``dspark serve`` process (the fault phase on its own
copy), the table and aims printed, the figures written to --json; exit 1 when an aim is missed."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import soak as package
from benchmarks.soak.phases import (phase_capacity, phase_disconnect, phase_fault, phase_overload, phase_sigterm,
                                    phase_soak)
from benchmarks.soak.report import aims, table
from benchmarks.soak.server import ServeProcess


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="engine directory")
    ap.add_argument("--requests", type=int, default=1000, help="soak requests after the warm-up")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=100, help="identical requests of the RSS control")
    ap.add_argument("--concurrency", type=int, default=8, help="soak clients")
    ap.add_argument("--max-tokens", type=int, default=24, help="soak requests ask 1..this many tokens")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=1024,
                    help="the server's context limit for the capacity phase (0: the engine's own)")
    ap.add_argument("--shutdown-timeout", type=float, default=5.0)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--overload-tokens", type=int, default=64)
    ap.add_argument("--disconnects", type=int, default=40)
    ap.add_argument("--sigterm-requests", type=int, default=8)
    ap.add_argument("--sigterm-tokens", type=int, default=512, help="length of the long in-flight requests")
    ap.add_argument("--step-delay", type=float, default=0.0,
                    help="test aid: seconds added to every decoding round (tiny engines)")
    ap.add_argument("--rss-aim-mb", type=float, default=50.0)
    ap.add_argument("--phases", default="soak,overload,disconnect,capacity,sigterm,fault")
    ap.add_argument("--workdir", default=None, help="where the fault phase copies the engine (default: $TMPDIR)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)

    from dspark_runtime.machine.sysinfo import machine_description

    engine = Path(args.engine)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    kw = dict(max_batch=args.max_batch, max_queue=args.max_queue, max_context=args.max_context or None,
              shutdown_timeout=args.shutdown_timeout, draft=args.draft, threads=args.threads,
              step_delay=args.step_delay)
    res = {"machine": machine_description(), "engine": str(engine), "config": vars(args), "phases": {}}
    print(f"machine: {res['machine']}\nengine: {engine}")
    t_start = time.monotonic()
    main_phases = [p for p in phases if p != "fault"]
    if main_phases:
        srv = ServeProcess(engine, **kw).start()
        res["server_cmd"] = "dspark " + " ".join(srv.args)
        res["max_context"] = srv.max_context
        print(f"server pid {srv.proc.pid} on {srv.url}: capacity {srv.capacity}, max context {srv.max_context}")
        try:
            for ph in main_phases:
                print(f"[{ph}]")
                try:
                    if ph == "soak":
                        r = phase_soak(srv, requests=args.requests, warmup=args.warmup, concurrency=args.concurrency,
                                       max_tokens=args.max_tokens, seed=args.seed, repeat=args.repeat)
                    elif ph == "overload":
                        r = phase_overload(srv, max_tokens=args.overload_tokens)
                    elif ph == "disconnect":
                        r = phase_disconnect(srv, n=args.disconnects, concurrency=args.concurrency,
                                             seed=args.seed + 1)
                    elif ph == "capacity":
                        r = phase_capacity(srv)
                    elif ph == "sigterm":
                        if "soak" in res["phases"]:
                            rss = srv.rss_mb()
                            res["rss_end_mb"] = rss
                            res["rss_growth_mb"] = rss - res["phases"]["soak"]["rss_warm_mb"]
                        r = phase_sigterm(srv, n=args.sigterm_requests, max_tokens=args.sigterm_tokens)
                    else:
                        raise SystemExit(f"unknown phase {ph!r}")
                except Exception as e:  # noqa: BLE001 - report the phase as missed, run the rest
                    r = {"exception": f"{type(e).__name__}: {e}"}
                    print(f"  phase failed: {r['exception']}")
                res["phases"][ph] = r
                if ph != "sigterm" and srv.alive:
                    res.setdefault("rss_after_phase_mb", {})[ph] = round(srv.rss_mb(), 1)
                if not srv.alive and ph != "sigterm":
                    res["phases"][ph]["exception"] = (f"the server exited (code {srv.proc.returncode}):\n"
                                                      f"{srv.log_tail()}")
                    break
        finally:
            res["server_log_tail"] = srv.log_tail(12)
            srv.kill()
    if "fault" in phases:
        print("[fault]")
        try:
            res["phases"]["fault"] = phase_fault(engine, workdir=args.workdir, server_kw=kw)
        except Exception as e:  # noqa: BLE001
            res["phases"]["fault"] = {"exception": f"{type(e).__name__}: {e}"}
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    a = aims(res, args.rss_aim_mb)
    res["aims"] = [{"aim": n, "met": ok, "figure": f} for n, ok, f in a]
    print()
    print(table(res, args.rss_aim_mb))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return 0 if all(ok for _, ok, _ in a) else 1


if __name__ == "__main__":
    sys.exit(main())
