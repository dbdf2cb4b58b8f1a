"""The soak's aims (each met or missed, with its figure) and its table of figures."""
from __future__ import annotations

import signal


def clean_exit(code) -> bool:
    """0, or killed by the SIGTERM it was sent (uvicorn re-raises a handled signal after a graceful shutdown)."""
    return code in (0, -signal.SIGTERM)


def aims(res: dict, rss_aim_mb: float) -> list:
    """[(aim, met, figure)] of a run's results."""
    a = []
    p = res.get("phases", {})
    if "soak" in p:
        s = p["soak"]
        a.append(("soak: every request completed (200)", s["completed"] == s["requests"] and not s["warmup_bad"],
                  f"{s['completed']}/{s['requests']}"))
        a.append((f"soak: RSS growth after warm-up < {rss_aim_mb:g} MB", s["rss_growth_mb"] < rss_aim_mb,
                  f"{s['rss_growth_mb']:+.1f} MiB"))
        if s.get("repeat"):
            a.append(("soak control: identical requests do not grow RSS (< 5 MB)",
                      s["rss_repeat_growth_mb"] < 5 and not s["repeat_bad"],
                      f"{s['rss_repeat_growth_mb']:+.1f} MiB over {s['repeat']}"))
    if "overload" in p:
        o = p["overload"]
        a.append(("overload: only 200/429, no 5xx, no hung connection", o["only_200_429"], str(o["status"])))
        a.append(("overload: the excess was shed (some 429)", o["rejected"] > 0, f"{o['rejected']} x 429"))
        a.append(("overload: server idle afterwards", o["idle_after"], str(o["idle_after"])))
    if "disconnect" in p:
        d = p["disconnect"]
        a.append(("disconnect: each request cancelled or finished, nothing left decoding or queued",
                  d["idle_after"] and d["all_accounted"] and not d["problems"],
                  f"{d['disconnects']} disconnects, {d['server_cancelled']} cancelled"))
        a.append(("disconnect: next request succeeds", d["next_request_outcome"] == "completed",
                  str(d["next_request_status"])))
    if "capacity" in p:
        c = p["capacity"]
        a.append(("capacity: 200 at the limit, 400 naming it over the limit, no 5xx", c["all_ok"] and not c["any_5xx"],
                  f"{sum(x['ok'] for x in c['cases'])}/{len(c['cases'])} cases"))
    if "sigterm" in p:
        t = p["sigterm"]
        a.append(("sigterm: every request was in flight at the signal", t["all_inflight_at_signal"],
                  str(t["health_polls"][-1:])))
        a.append(("sigterm: each in-flight request finished or ended with a clean error", t["unclean"] == 0,
                  f"{t['completed']} finished, {t['clean_errors']} clean errors, {t['unclean']} unclean"))
        a.append(("sigterm: the process exited in time, cleanly", t["exit_code"] is not None
                  and clean_exit(t["exit_code"]), f"exit {t['exit_code']} after {t['exit_s']} s"))
    if "fault" in p:
        f = p["fault"]
        for st in f.get("steps", []):
            a.append((f"fault ({st['damage']}): dspark verify reports it, naming the file",
                      st["verify_failed"] and st["verify_names_file"], f"exit {st['verify']['exit_code']}"))
            a.append((f"fault ({st['damage']}): server survives its in-flight requests",
                      st["server_alive"] and set(st["inflight_outcome"]) <= {"completed", "error_body", "error_event"},
                      str(st["inflight_outcome"])))
        if "error" in f:
            a.append(("fault: phase ran", False, f["error"]))
    for name, ph in p.items():
        if isinstance(ph, dict) and "exception" in ph:
            a.append((f"{name}: phase ran", False, ph["exception"]))
    return a


def table(res: dict, rss_aim_mb: float) -> str:
    p = res.get("phases", {})
    rows = []
    fmt = lambda x, f="{:.3f}": "-" if x is None else f.format(x)  # noqa: E731
    if "soak" in p:
        s = p["soak"]
        rows += [("requests (after warm-up)", f"{s['requests']} (+{s['warmup']} warm-up), {s['concurrency']} clients"),
                 ("status counts", str(s["status"])),
                 ("throughput", f"{s['requests_per_s']} req/s over {s['wall_s']} s"),
                 ("latency p50 / p95 / max", f"{fmt(s['p50_latency_s'])} / {fmt(s['p95_latency_s'])} / "
                                            f"{fmt(s['max_latency_s'])} s"),
                 ("RSS after warm-up", f"{s['rss_warm_mb']:.1f} MiB"),
                 ("RSS after the soak", f"{s['rss_end_mb']:.1f} MiB ({s['rss_growth_mb']:+.1f} MiB; second half "
                                        f"{s['rss_growth_second_half_mb']:+.1f} MiB)"),
                 ("RSS, identical requests (control)", f"{s['rss_repeat_growth_mb']:+.1f} MiB over {s['repeat']} "
                                                       f"requests one at a time")]
    if "rss_end_mb" in res:
        rows.append(("RSS at the end (before SIGTERM)", f"{res['rss_end_mb']:.1f} MiB ({res['rss_growth_mb']:+.1f} "
                                                        f"MiB since warm-up)"))
    if res.get("rss_after_phase_mb"):
        rows.append(("RSS after each phase", ", ".join(f"{k} {v:.0f}" for k, v in res["rss_after_phase_mb"].items())
                     + " MiB"))
    if "overload" in p:
        o = p["overload"]
        rows.append(("overload (clients / capacity)", f"{o['clients']} / {o['capacity']}: {o['status']}"))
    if "disconnect" in p:
        d = p["disconnect"]
        rows.append(("disconnects (server cancelled)", f"{d['disconnects']} of {d['clients']} clients "
                                                       f"({d['server_cancelled']}); server outcomes "
                                                       f"{d['server_outcomes']}; next request "
                                                       f"{d['next_request_status']}"))
    if "capacity" in p:
        c = p["capacity"]
        rows.append(("capacity cases ok", f"{sum(x['ok'] for x in c['cases'])}/{len(c['cases'])} at max context "
                                          f"{c['max_context']}"))
    if "sigterm" in p:
        t = p["sigterm"]
        rows += [("SIGTERM outcome", f"{t['inflight']} in flight: {t['completed']} finished, {t['clean_errors']} "
                                     f"clean errors, {t['unclean']} unclean"),
                 ("exit code (time)", f"{t['exit_code']} ({t['exit_s']} s, bound {t['bound_s']:g} s)")]
    if "fault" in p:
        for st in p["fault"].get("steps", []):
            rows.append((f"fault: {st['damage']} {p['fault']['file']}",
                         f"in flight {st['inflight_outcome']}; alive {st['server_alive']}; verify exit "
                         f"{st['verify']['exit_code']}"))
    w = max(len(r[0]) for r in rows) if rows else 0
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    lines.append("")
    for name, ok, fig in aims(res, rss_aim_mb):
        lines.append(f"[{'ok' if ok else 'MISSED'}] {name}: {fig}")
    return "\n".join(lines)
