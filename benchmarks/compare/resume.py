"""Resume: every finished (prompt, system) row is appended to ``<out-dir>/progress.jsonl`` as it finishes.

``--resume`` with the same settings (:data:`FINGERPRINT_KEYS` and the prompts) skips the pairs already done, each
chunk still running its remaining systems in the rotated order; other settings are refused, naming them. Without
``--resume`` an existing progress file is moved aside.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path


PROGRESS = "progress.jsonl"
# the settings a resumed run must share with the interrupted one
FINGERPRINT_KEYS = ("target", "draft_name", "engine", "datasets", "n", "max_new_tokens", "temperatures", "seed",
                    "chunk", "threads", "systems", "system_options", "peer_models")


def fingerprint(settings: dict, prompts: list) -> dict:
    """What must match for --resume: the settings above and the prompts themselves (keys and texts)."""
    fp = {k: settings.get(k) for k in FINGERPRINT_KEYS}
    fp["prompts"] = hashlib.sha1(json.dumps([[p["key"], p["text"]] for p in prompts]).encode()).hexdigest()
    return json.loads(json.dumps(fp))  # tuples -> lists, as read back from JSON


def fingerprint_mismatch(saved: dict, current: dict) -> list:
    """The keys whose values differ (sorted)."""
    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))


def read_progress(path: Path) -> dict:
    """{"fingerprint", "rows" (the last row of each (system, key), errors included), "workers" (tag -> meta)}
    from a progress file; a torn last line (killed mid-write) is ignored."""
    fp, rows, workers = None, {}, {}
    for line in Path(path).read_text().splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "fingerprint" in obj:
            fp = obj["fingerprint"]
        elif "row" in obj:
            r = obj["row"]
            rows[(r["system"], r["key"])] = {**r, "_tag": obj.get("tag")}
        elif "worker" in obj:
            workers[obj.get("tag")] = obj["worker"]
    return {"fingerprint": fp, "rows": rows, "workers": workers}


def done_rows(progress: dict) -> list:
    """The finished rows (no error) of a progress file, their peak RSS set from their worker when it finished."""
    out = []
    for r in progress["rows"].values():
        if r.get("error"):
            continue
        r = dict(r)
        w = progress["workers"].get(r.pop("_tag", None))
        if w and w.get("peak_rss_mb") is not None:
            r["peak_rss_mb"] = w["peak_rss_mb"]
        out.append(r)
    return out


def rotate(seq: list, c: int) -> list:
    """``seq`` rotated left by c (the system order of chunk c)."""
    if not seq:
        return []
    c %= len(seq)
    return list(seq[c:]) + list(seq[:c])


def schedule(chunks: list, systems: list, done: set) -> list:
    """[(chunk number, system, prompts of that chunk not yet done by that system)], in run order: for chunk c
    the systems rotated by c, as a fresh run; (chunk, system) pairs with nothing left are dropped."""
    plan = []
    for c, chunk in enumerate(chunks):
        for s in rotate(systems, c):
            todo = [p for p in chunk if (s, p["key"]) not in done]
            if todo:
                plan.append((c, s, todo))
    return plan


def open_progress(out_dir: Path, fp: dict, resume: bool) -> tuple:
    """(path, finished rows, worker metas) of the run's progress file. ``resume``: the file's fingerprint must
    equal ``fp`` (SystemExit naming the differing settings otherwise); a missing file starts afresh. Without
    ``resume`` an existing file is moved aside (progress.<time>.jsonl) and a new one started."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PROGRESS
    if resume and path.is_file():
        prog = read_progress(path)
        if prog["fingerprint"] is None:
            raise SystemExit(f"error: {path} has no settings line; cannot resume from it (move it away to start afresh)")
        bad = fingerprint_mismatch(prog["fingerprint"], fp)
        if bad:
            detail = "; ".join(f"{k}: was {json.dumps(prog['fingerprint'].get(k))[:120]}, now "
                               f"{json.dumps(fp.get(k))[:120]}" for k in bad)
            raise SystemExit(f"error: --resume with other settings than the run in {path}: {detail}. Re-run with the "
                             "same settings, or drop --resume to start a new run (the old progress file is kept aside)")
        rows = done_rows(prog)
        return path, rows, [w for w in prog["workers"].values()]
    if resume:
        print(f"--resume: no {path}; starting a new run", file=sys.stderr)
    elif path.is_file():
        aside = out_dir / f"progress.{time.strftime('%Y%m%d-%H%M%S', time.localtime(path.stat().st_mtime))}.jsonl"
        path.rename(aside)
        print(f"moved the previous run's {path.name} to {aside.name} (use --resume to continue a run)", file=sys.stderr)
    with open(path, "w") as f:
        f.write(json.dumps({"fingerprint": fp}) + "\n")
    return path, [], []


def append_progress(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())
