"""``dspark-export profile``: the cost table of a speculative round on this machine, for the verify-length
scheduler, and the row padding that makes speculative output bit-exact here.

A round costs the drafting pass plus one verifier step over B = 1 + ℓ tokens, so SPS(B) = 1 / (t_draft +
t_verify(B)) (docs/design.md §1 step 4). :func:`profile_engine` measures both after a warm-up, as the median of
``repeats`` runs, at several context buckets (:mod:`dspark_runtime.scheduling.cost_table`), and stores the table in
the manifest (``speculation.cost_table``) with the CPU it was measured on (``Engine.load`` warns on another one). The
table belongs to the deployment machine: re-profile there. The manifest is replaced in one transaction after the
measurements: an error or Ctrl-C leaves it as it was.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path

from dspark_runtime.engine import DEFAULT_THREADS, Engine
from dspark_runtime.engine_dir.manifest import load_manifest
from dspark_runtime.machine.cost_profile import engine_contexts, profile_runtime
from dspark_runtime.machine.sysinfo import OtherCpuWarning, cpu_features, machine_description

from dspark_export.engine_dir.transaction import engine_transaction


def profile_engine(engine_dir: Path, *, max_tokens: int = 8, context=None, repeats: int = 5,
                   threads: int | None = None, write: bool = True, draft_rows=(1, 2, 4, 8),
                   probe_rows: bool = True, probe_only: bool = False, shared_thread_pool: bool = False) -> dict:
    """Profile ``engine_dir`` and (``write``) store the table as ``speculation.cost_table`` in its manifest.

    ``context``: the cached-position buckets to time (an int or a sequence of ints; None:
    :data:`~dspark_runtime.machine.cost_profile.DEFAULT_CONTEXTS`, those the engine's context holds); see
    :func:`~dspark_runtime.machine.cost_profile.profile_runtime` for the table's form.

    With ``probe_rows`` it first measures the target's row-count invariance on this machine
    (:meth:`Engine.probe_row_invariance`, ~1 minute for a 1.5B model on 2 cores), stores it as
    ``speculation.row_invariance`` (the runtime then pads every target call to that row multiple, so
    speculative greedy output is bit for bit the target-only output) and times the cost table with that
    padding in effect. The table is returned with the probe under "row_invariance". ``probe_only``: probe
    and store ``row_invariance`` only, keeping the manifest's cost table (returns {"row_invariance": probe}).

    Raises ValueError for ``probe_only`` without ``probe_rows``, InputError for contexts that are not integers >= 8
    or do not fit the engine's context (before anything is measured), ManifestError/DSparkError when the engine does
    not load, DSparkError when the manifest cannot be written (read-only directory, full disk; it is then
    unchanged).
    """
    if probe_only and not probe_rows:
        raise ValueError("probe_only needs probe_rows=True (nothing would be measured)")

    with warnings.catch_warnings():  # records made on another CPU: being re-measured here
        warnings.simplefilter("ignore", OtherCpuWarning)
        eng = Engine.load(engine_dir, threads=threads or DEFAULT_THREADS, row_multiple=1 if probe_rows else None,
                          shared_thread_pool=shared_thread_pool)
    if not probe_only:  # bad contexts fail now, not after the minute-long row probe
        engine_contexts(eng, context, max_tokens=max_tokens)
    probe = None
    if probe_rows:
        import onnxruntime

        probe = eng.probe_row_invariance()
        probe.update(machine=machine_description(), cpu=cpu_features(), threads=threads or DEFAULT_THREADS,
                     onnxruntime=onnxruntime.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    if probe_only:
        if write:
            _store(engine_dir, {"row_invariance": probe})
        return {"row_invariance": probe}
    table = profile_runtime(eng, max_tokens=max_tokens, context=context, repeats=repeats, draft_rows=draft_rows)
    table["machine"] = machine_description()
    table["cpu"] = cpu_features()  # Engine.load warns when the engine runs on another CPU
    table["threads"] = threads or DEFAULT_THREADS
    if write:
        _store(engine_dir, {"cost_table": table, **({"row_invariance": probe} if probe is not None else {})})
    if probe is not None:
        table = {**table, "row_invariance": probe}
    return table


def _store(engine_dir: Path, records: dict) -> None:
    """Set ``speculation.<k> = v`` for each of ``records`` (keys: fields of
    :class:`~dspark_runtime.engine_dir.manifest.Speculation`, e.g. cost_table, row_invariance) in the manifest of
    ``engine_dir``, in one transaction."""
    with engine_transaction(engine_dir) as txn:
        m = load_manifest(engine_dir, verify=False)
        for k, v in records.items():
            setattr(m.speculation, k, v)
        txn.commit(m)
