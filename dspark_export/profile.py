"""``dspark-export profile``: the cost table of a round on this machine, for the verify-length scheduler.

A speculative round costs the drafting pass (fixed: the DSpark block is drafted in full) plus one
verifier step over B = 1 + ℓ tokens, so SPS(B) = 1 / (t_draft + t_verify(B)) rounds per second
(DESIGN.md §1 step 4). ``profile_engine`` measures both on the engine at hand, after a warm-up, as
the median of ``repeats`` runs, at a given context length (the verifier's cost grows with the KV
cache), and stores the table in the manifest (``speculation.cost_table``). The table belongs to the
deployment machine: re-profile there (``dspark generate --profile-on-load`` does it at load).
"""
from __future__ import annotations

from pathlib import Path

from dspark_runtime.profile import PROFILE_POINTS, profile_runtime  # noqa: F401  (re-exported)


def profile_engine(engine_dir: Path, *, max_tokens: int = 8, context: int = 256, repeats: int = 5,
                   threads: int | None = None, write: bool = True, draft_rows=(1,)) -> dict:
    """Profile ``engine_dir`` and (``write``) store the table as ``speculation.cost_table`` in its manifest."""
    from dspark_runtime.engine import DEFAULT_THREADS, Engine
    from dspark_runtime.manifest import load_manifest

    from dspark_runtime.sysinfo import machine_description

    eng = Engine.load(engine_dir, threads=threads or DEFAULT_THREADS)
    table = profile_runtime(eng, max_tokens=max_tokens, context=context, repeats=repeats, draft_rows=draft_rows)
    table["machine"] = machine_description()
    table["threads"] = threads or DEFAULT_THREADS
    if write:
        m = load_manifest(engine_dir, verify=False)
        m.speculation["cost_table"] = table
        m.write(Path(engine_dir))
    return table
