"""Writing an engine directory's manifest with its provenance: the machine the graphs were built on
(``build_machine``) and the tool versions.

:func:`commit_manifest` commits a transaction (:mod:`dspark_export.engine_dir.transaction`) for the commands that
change an engine directory in place; :func:`write_manifest` writes the manifest of a new directory
(``quantize``). Both record this machine as ``build_machine`` only when the manifest has none, so an engine
keeps the machine its graphs were first written and validated on.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from dspark_runtime.engine_dir.integrity import record_verified
from dspark_runtime.engine_dir.manifest import Manifest
from dspark_runtime.machine.sysinfo import cpu_features

from dspark_export.engine_dir.transaction import EngineTransaction

TOOL_PACKAGES = ("dspark", "torch", "transformers", "onnx", "onnxscript", "onnxruntime")


def tool_versions() -> dict:
    """``{package: version}`` of the installed :data:`TOOL_PACKAGES` (the manifest's ``tool_versions``)."""
    out = {}
    for pkg in TOOL_PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def build_machine() -> dict:
    """The manifest's ``build_machine``: the CPU of this machine (:func:`dspark_runtime.machine.sysinfo.cpu_features`),
    on which the graphs are written and their validation figures measured."""
    return cpu_features()


def commit_manifest(txn: EngineTransaction, manifest: Manifest) -> None:
    """Commit ``txn`` (:meth:`~dspark_export.engine_dir.transaction.EngineTransaction.commit`) with ``manifest``,
    recording this machine as ``build_machine`` when the manifest has none (an engine built before it was
    recorded). Raises what the commit raises; the engine directory is then unchanged."""
    if not manifest.build_machine:
        manifest.build_machine = build_machine()
    txn.commit(manifest)


def write_manifest(manifest: Manifest, out_dir: Path) -> None:
    """Write ``manifest`` into the new engine directory ``out_dir`` (atomically), recording this machine as
    ``build_machine`` when the manifest has none, and record its files as hashed (the caller hashed or verified
    them), so the first load need not hash the weights again. Commands that change an existing engine directory
    use :func:`commit_manifest` instead. Raises OSError when it cannot write."""
    if not manifest.build_machine:
        manifest.build_machine = build_machine()
    manifest.write(out_dir)
    record_verified(out_dir, manifest.all_files())
