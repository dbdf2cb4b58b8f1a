"""Issue 18, "nothing a user built is lost": every command that changes an engine directory in place (`build` over
an existing engine, `add-draft`, `profile`, `calibrate`, `build-trt`) is a transaction (dspark_export/engine_dir/transaction.py), and
trusted-hash records live in the user's cache, so a read-only engine directory is hashed once, not on every load.

Each fault test injects a failure (an exception, KeyboardInterrupt, a full disk) at one step and checks that the
engine directory's file listing and every file's bytes are exactly as before.
"""
import builtins
import errno
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_runtime.errors import DSparkError, ManifestError
from dspark_runtime.engine_dir.manifest import FileEntry, load_manifest

pytest.importorskip("torch")

QUIET = dict(log=lambda *a: None)


# -- helpers


def snapshot(d: Path) -> dict:
    """Every entry under ``d``, hidden ones included: relative path -> sha256 of the file's bytes ("<dir>" for
    a folder)."""
    out = {}
    for p in sorted(Path(d).rglob("*")):
        rel = p.relative_to(d).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_dir():
            out[rel] = "<dir>"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_unchanged(d: Path, before: dict):
    after = snapshot(d)
    assert sorted(after) == sorted(before), "file listing changed"
    assert after == before, "file contents changed"


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Trusted-hash records in a cache of the test's own."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture()
def engine_copy(tiny_engine_dir, tmp_path):
    d = tmp_path / "eng"
    shutil.copytree(tiny_engine_dir, d)
    return d


@pytest.fixture()
def dspark_copy(tiny_dspark, tmp_path):
    d = tmp_path / "dspark-eng"
    shutil.copytree(tiny_dspark[0], d)
    return d


class _FailingFile:
    """A file opened for writing whose writes fail (a full disk: the open truncated it, the write fails)."""

    def __init__(self, f, exc):
        self._f, self._exc = f, exc

    def write(self, *a, **k):
        raise self._exc

    writelines = write

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self._f.close()

    def __iter__(self):
        return iter(self._f)


def fail_writes(monkeypatch, under: Path, exc: BaseException, name_contains: str = ""):
    """Make every Python-level write to a file under ``under`` (whose name contains ``name_contains``) raise
    ``exc``, as a full disk does: ``open`` for writing still creates/truncates the file."""
    real_open = builtins.open
    under = os.path.realpath(under)

    def fake_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            p = os.path.realpath(os.fsdecode(file))
            if p.startswith(under + os.sep) and name_contains in os.path.basename(p):
                return _FailingFile(f, exc)
        return f

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)


def raiser(exc):
    def f(*a, **k):
        raise exc
    return f


ENOSPC = OSError(errno.ENOSPC, "No space left on device")
FAULTS = {"ENOSPC": ENOSPC, "KeyboardInterrupt": KeyboardInterrupt(), "error": RuntimeError("injected failure")}


def expect_failure(exc):
    """pytest.raises for a fault: ENOSPC becomes the transaction's DSparkError naming the full disk (the old code
    let the bare OSError through, which this also accepts so that the test fails on the directory check)."""
    if exc is ENOSPC:
        return pytest.raises((DSparkError, OSError), match="[Nn]o space left")
    return pytest.raises(type(exc))


def stage_dirs(d: Path) -> list:
    return sorted(p.name for p in Path(d).iterdir() if p.name.startswith(".dspark-txn-"))


# -- build over an existing engine directory


def _recipe(tiny_pair):
    from dspark_export.engine_dir.build import Recipe

    tdir, ddir = tiny_pair
    return Recipe(name="tiny", target=str(tdir), draft=str(ddir), target_feature_layers=[-1, 0], draft_length=4)


def _fault_tokenizer(monkeypatch, d):
    import dspark_export.engine_dir.build as build

    monkeypatch.setattr(build, "_copy_tokenizer", raiser(RuntimeError("injected failure")))
    return RuntimeError("")


def _fault_draft_export(monkeypatch, d):
    """The target graph is exported; the draft's export writes part of its file, then Ctrl-C."""
    import dspark_export.engine_dir.build as build

    real = build.export_graph

    def export(model_dir, out_path, *a, **k):
        if Path(out_path).name == "draft.onnx":
            Path(out_path).write_bytes(b"partial graph")
            raise KeyboardInterrupt
        return real(model_dir, out_path, *a, **k)

    monkeypatch.setattr(build, "export_graph", export)
    return KeyboardInterrupt()


def _fault_hashing(monkeypatch, d):
    real = FileEntry.of

    def of(root, rel):
        if rel == "draft.onnx.data":
            raise KeyboardInterrupt
        return real(root, rel)

    monkeypatch.setattr(FileEntry, "of", staticmethod(of))
    return KeyboardInterrupt()


def _fault_manifest_enospc(monkeypatch, d):
    fail_writes(monkeypatch, d, ENOSPC, name_contains="manifest")
    return ENOSPC


def _fault_move(monkeypatch, d):
    """Every file is written; moving them into place fails half-way (the third rename)."""
    real, calls = os.replace, []

    def replace(src, dst, **k):
        if ".dspark-txn-" in os.fspath(src) or ".dspark-txn-" in os.fspath(dst):
            calls.append(src)
            if len(calls) == 3:
                raise OSError(errno.EIO, "injected I/O error")
        return real(src, dst, **k)

    monkeypatch.setattr(os, "replace", replace)
    return OSError(errno.EIO, "")


BUILD_FAULTS = {"tokenizer copy": _fault_tokenizer, "draft export, Ctrl-C": _fault_draft_export,
                "hashing, Ctrl-C": _fault_hashing, "manifest write, full disk": _fault_manifest_enospc,
                "moving files into place": _fault_move}


@pytest.mark.parametrize("step", list(BUILD_FAULTS))
def test_build_over_an_engine_fails_cleanly(step, engine_copy, tiny_pair, monkeypatch):
    from dspark_export.engine_dir.build import build_engine

    (engine_copy / "notes.txt").write_text("the user's own file\n")
    before = snapshot(engine_copy)
    exc = BUILD_FAULTS[step](monkeypatch, engine_copy)
    with expect_failure(exc):
        build_engine(_recipe(tiny_pair), engine_copy, isolate=False, **QUIET)
    monkeypatch.undo()
    assert_unchanged(engine_copy, before)
    load_manifest(engine_copy, rehash=True)  # and it still loads


def test_build_into_a_new_directory_leaves_nothing_on_failure(tiny_pair, tmp_path, monkeypatch):
    from dspark_export.engine_dir.build import build_engine

    out = tmp_path / "new" / "engine"
    _fault_draft_export(monkeypatch, out)
    with pytest.raises(KeyboardInterrupt):
        build_engine(_recipe(tiny_pair), out, isolate=False, **QUIET)
    assert not (tmp_path / "new").exists()


def test_build_over_an_engine_replaces_it(engine_copy, tiny_pair, monkeypatch):
    """A successful rebuild: new files in place, the legacy hash sidecar and the stage gone, the user's files
    kept, files the new manifest no longer lists deleted, and the first load hashes nothing."""
    import dspark_runtime.engine_dir.integrity as integrity
    from dspark_export.engine_dir.build import Recipe, build_engine

    (engine_copy / "notes.txt").write_text("the user's own file\n")
    (engine_copy / ".dspark-verified.json").write_text("{}")  # left by an older dspark
    build_engine(Recipe(name="tiny", target=str(tiny_pair[0]), target_feature_layers=[-1, 0]), engine_copy,
                 isolate=False, **QUIET)  # no draft LM this time
    names = {p.name for p in engine_copy.iterdir()}
    assert "notes.txt" in names and "draft.onnx" not in names and "draft.onnx.data" not in names
    assert ".dspark-verified.json" not in names and not stage_dirs(engine_copy)
    calls = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    m = load_manifest(engine_copy)
    assert calls == [] and set(m.graphs) == {"target"}  # recorded as hashed at commit
    load_manifest(engine_copy, rehash=True)


# -- the transaction's commit, step by step


def _change(txn, m):
    """A change touching every kind of commit step: a replaced file, a new file in a new folder, an extra file
    (not in the manifest), and superseded files (the draft graph is dropped)."""
    (txn.stage / "target.onnx.data").write_bytes(b"new weights")
    m.graphs["target"].files[1] = FileEntry.of(txn.stage, "target.onnx.data")
    (txn.stage / "newdir").mkdir()
    (txn.stage / "newdir" / "x.bin").write_bytes(b"x" * 1000)
    m.tokenizer["files"].append(FileEntry.of(txn.stage, "newdir/x.bin"))
    txn.add("calibration.json").write_text("{}\n")
    m.graphs.pop("draft")
    m.speculation.draft_graph = None
    txn.commit(m)


# renames of a commit: newdir/x.bin (1), target.onnx.data aside (2) and in (3), calibration.json (4), manifest (5)
COMMIT_STEPS = [(1, "error"), (2, "KeyboardInterrupt"), (3, "error"), (4, "KeyboardInterrupt"), (5, "error"),
                (5, "ENOSPC")]


@pytest.mark.parametrize("n,fault", COMMIT_STEPS)
def test_commit_fails_at_each_step_and_rolls_back(n, fault, engine_copy, monkeypatch):
    from dspark_export.engine_dir.transaction import engine_transaction

    before = snapshot(engine_copy)
    real, calls = os.replace, []

    def replace(src, dst, **k):
        if os.fspath(dst).startswith(str(engine_copy)):  # not the trusted-hash cache's writes
            calls.append(dst)
            if len(calls) == n:
                raise FAULTS[fault] if fault != "error" else OSError(errno.EIO, "injected I/O error")
        return real(src, dst, **k)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises((OSError, KeyboardInterrupt, DSparkError)):
        with engine_transaction(engine_copy) as txn:
            _change(txn, load_manifest(engine_copy))
    monkeypatch.undo()
    assert_unchanged(engine_copy, before)


def test_commit_full_disk_on_the_manifest_write(engine_copy, monkeypatch):
    from dspark_export.engine_dir.transaction import engine_transaction

    before = snapshot(engine_copy)
    with pytest.raises(DSparkError, match="no space left on the device .* left as it was. Free space"):
        with engine_transaction(engine_copy) as txn:
            m = load_manifest(engine_copy)
            fail_writes(monkeypatch, engine_copy, ENOSPC, name_contains="manifest")
            _change(txn, m)
    monkeypatch.undo()
    assert_unchanged(engine_copy, before)


def test_ctrl_c_during_the_moves_is_held_then_rolls_back(engine_copy, monkeypatch):
    """A real SIGINT arriving while files are moved into place: the moves finish (or are undone), never half."""
    from dspark_export.engine_dir.transaction import engine_transaction

    before = snapshot(engine_copy)
    real, calls = os.replace, []

    def replace(src, dst, **k):
        if os.fspath(dst).startswith(str(engine_copy)):
            calls.append(dst)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)
        return real(src, dst, **k)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        with engine_transaction(engine_copy) as txn:
            _change(txn, load_manifest(engine_copy))
    monkeypatch.undo()
    assert len(calls) >= 4  # the moves went on after the signal, then were undone
    assert_unchanged(engine_copy, before)


def test_commit_succeeds(engine_copy, monkeypatch):
    import dspark_runtime.engine_dir.integrity as integrity
    from dspark_export.engine_dir.transaction import engine_transaction

    (engine_copy / ".dspark-verified.json").write_text("{}")
    with engine_transaction(engine_copy) as txn:
        _change(txn, load_manifest(engine_copy))
    names = {p.relative_to(engine_copy).as_posix() for p in engine_copy.rglob("*")}
    assert {"newdir/x.bin", "calibration.json", "target.onnx.data"} <= names
    assert not names & {"draft.onnx", "draft.onnx.data", ".dspark-verified.json"} and not stage_dirs(engine_copy)
    assert (engine_copy / "target.onnx.data").read_bytes() == b"new weights"
    calls = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: calls.append(Path(p).name) or real(p, *a, **k))
    load_manifest(engine_copy)
    assert "target.onnx.data" not in calls and "x.bin" not in calls  # written and hashed by the transaction


KILLED = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})  # the repository, for the tests package
from dspark_export.engine_dir.transaction import engine_transaction
from dspark_runtime.engine_dir.manifest import load_manifest
from tests.export.engine_dir.test_transaction import _change

d, n = Path(sys.argv[1]), int(sys.argv[2])
real, calls = os.replace, []
def replace(src, dst, **k):
    if os.fspath(dst).startswith(str(d)):
        calls.append(dst)
        if len(calls) == n:
            os._exit(9)  # killed: no exception handler runs
    return real(src, dst, **k)
os.replace = replace
real_unlink = Path.unlink
def unlink(self, *a, **k):
    if n == 0 and self.name == "draft.onnx":  # n == 0: killed right after the commit point
        os._exit(9)
    return real_unlink(self, *a, **k)
Path.unlink = unlink
with engine_transaction(d) as txn:
    _change(txn, load_manifest(d))
"""


@pytest.mark.parametrize("n", [2, 3, 5, 0])
def test_a_killed_commit_is_recovered_by_the_next_transaction(n, engine_copy):
    """SIGKILL / power loss during a commit: the next transaction rolls it back (before the commit point) or
    finishes it (after)."""
    from dspark_export.engine_dir.transaction import engine_transaction

    before = snapshot(engine_copy)
    code = KILLED.format(root=str(Path(__file__).resolve().parents[3]))
    r = subprocess.run([sys.executable, "-c", code, str(engine_copy), str(n)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 9, r.stderr
    assert stage_dirs(engine_copy)  # the journal of the interrupted commit
    with engine_transaction(engine_copy):
        pass  # recovers; commits nothing
    assert not stage_dirs(engine_copy)
    if n:
        assert_unchanged(engine_copy, before)
    else:
        m = load_manifest(engine_copy, rehash=True)
        assert "draft" not in m.graphs and (engine_copy / "calibration.json").is_file()


def test_a_second_command_on_the_same_directory_is_refused(engine_copy):
    from dspark_export.engine_dir.transaction import engine_transaction

    with engine_transaction(engine_copy):
        with pytest.raises(DSparkError, match="another dspark-export command is changing"):
            with engine_transaction(engine_copy):
                pass


# -- add-draft


def test_add_draft_with_other_feature_layers_leaves_the_engine(engine_copy, tiny_dspark, tiny_pair, tmp_path):
    """The feature-layer check fails after the old code had deleted manifest.json: the engine stays loadable."""
    from dspark_export.engine_dir.add_draft import add_dspark_draft

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dspark[1], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["target_layer_ids"] = [0, 1]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    before = snapshot(engine_copy)
    with pytest.raises(DSparkError, match="rebuild the target with those feature layers"):
        add_dspark_draft(engine_copy, ckpt, str(tiny_pair[0]), isolate=False, **QUIET)
    assert_unchanged(engine_copy, before)
    load_manifest(engine_copy, rehash=True)


@pytest.mark.parametrize("fault", ["KeyboardInterrupt", "ENOSPC"])
def test_add_draft_export_failure_leaves_the_engine(fault, dspark_copy, tiny_dspark, tiny_pair, monkeypatch):
    """Replacing the DSpark drafter of an engine: the export writes part of the new graph, then fails."""
    import dspark_export.drafter.graph as dg
    from dspark_export.engine_dir.add_draft import add_dspark_draft

    before = snapshot(dspark_copy)

    def export(ckpt, target_dir, out_dir, role, *_):
        (Path(out_dir) / f"{role}.onnx").write_bytes(b"partial graph")
        raise FAULTS[fault]

    monkeypatch.setattr(dg, "export_dspark", export)
    with expect_failure(FAULTS[fault]):
        add_dspark_draft(dspark_copy, tiny_dspark[1], str(tiny_pair[0]), isolate=False, **QUIET)
    assert_unchanged(dspark_copy, before)
    load_manifest(dspark_copy, rehash=True)


def test_add_draft_succeeds_and_records_its_hashes(engine_copy, tiny_dspark, tiny_pair, monkeypatch):
    import dspark_runtime.engine_dir.integrity as integrity
    from dspark_export.engine_dir.add_draft import add_dspark_draft

    add_dspark_draft(engine_copy, tiny_dspark[1], str(tiny_pair[0]), isolate=False, **QUIET)
    assert not stage_dirs(engine_copy)
    assert not (engine_copy / ".dspark-verified.json").exists()  # hash records go to the user's cache
    calls = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: calls.append(Path(p).name) or real(p, *a, **k))
    m = load_manifest(engine_copy)
    assert {"draft", "dspark"} <= set(m.graphs) and m.speculation.dspark.graph == "dspark"
    assert not {"dspark.onnx", "dspark.onnx.data", "dspark_heads.npz"} & set(calls)
    load_manifest(engine_copy, rehash=True)


# -- profile and calibrate


@pytest.mark.parametrize("fault", ["ENOSPC", "KeyboardInterrupt"])
def test_profile_failing_to_write_leaves_the_manifest(fault, engine_copy, monkeypatch):
    from dspark_export.fit.cost_profile import profile_engine

    before = snapshot(engine_copy)
    fail_writes(monkeypatch, engine_copy, FAULTS[fault], name_contains="manifest")
    with expect_failure(FAULTS[fault]):
        profile_engine(engine_copy, max_tokens=2, context=16, repeats=1, threads=1, probe_rows=False)
    monkeypatch.undo()
    assert_unchanged(engine_copy, before)
    load_manifest(engine_copy, rehash=True)


@pytest.mark.parametrize("fault", ["ENOSPC", "KeyboardInterrupt"])
def test_calibrate_failing_to_write_leaves_the_engine(fault, dspark_copy, tiny_dspark, tmp_path, monkeypatch):
    """calibration.json cannot be written: the old code had already replaced the manifest."""
    from dspark_export.fit.calibrate_drafter import calibrate_engine

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dspark[1], ckpt)
    m = json.loads((dspark_copy / "manifest.json").read_text())
    m["graphs"]["draft"]["model_id"] = f"dspark:{ckpt}"  # sts.json would go to this copy
    (dspark_copy / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    before, ckpt_before = snapshot(dspark_copy), snapshot(ckpt)
    fail_writes(monkeypatch, dspark_copy, FAULTS[fault], name_contains="calibration")
    with expect_failure(FAULTS[fault]):
        calibrate_engine(dspark_copy, n_prompts=2, max_new_tokens=16, save_to_checkpoint=True, **QUIET)
    monkeypatch.undo()
    assert_unchanged(dspark_copy, before)
    assert_unchanged(ckpt, ckpt_before)
    load_manifest(dspark_copy, rehash=True)


# -- build-trt (the TensorRT build itself replaced by a stand-in: the transaction is what is tested)


def _fake_trt_build(fail_on=None, exc=None):
    def build(onnx_path, spec, out_path, settings):
        Path(out_path).write_bytes(b"engine of " + Path(onnx_path).name.encode())
        if fail_on is not None and Path(out_path).name == fail_on:
            raise exc
        return {"flavour": "tensorrt-rtx", "version": "0.0-test", "profiles": [], "compute_capabilities": ["8.6"],
                "precision": "fp32", "build_seconds": 0.0, "peak_rss_bytes": 0}
    return build


@pytest.mark.parametrize("fault", ["error", "KeyboardInterrupt", "ENOSPC"])
def test_build_trt_failing_on_the_second_engine_leaves_the_engine(fault, engine_copy, monkeypatch):
    import dspark_export.engine_dir.trt_build as trt
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt

    before = snapshot(engine_copy)
    exc = DSparkError("injected TensorRT failure") if fault == "error" else FAULTS[fault]
    monkeypatch.setattr(trt, "build_engine_file", _fake_trt_build("target.engine", exc))
    with expect_failure(exc):
        build_trt(engine_copy, TrtBuildSettings(kv_layouts=("capacity", "growing"), graphs=("target",)),
                  isolate=False, **QUIET)
    assert_unchanged(engine_copy, before)
    load_manifest(engine_copy, rehash=True)


def test_build_trt_interrupted_in_the_16_bit_conversion_leaves_the_engine(engine_copy, monkeypatch):
    import dspark_export.engine_dir.trt_build as trt
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt

    before = snapshot(engine_copy)
    real = trt.to_half

    def to_half(src, dst, half):
        real(src, dst, half)
        raise KeyboardInterrupt

    import dspark_export.graphs.device as device_graphs

    monkeypatch.setattr(trt, "to_half", to_half)
    monkeypatch.setattr(device_graphs, "to_half", to_half)  # the capacity layout's 16-bit copy is made there
    monkeypatch.setattr(trt, "build_engine_file", _fake_trt_build())
    with pytest.raises(KeyboardInterrupt):
        build_trt(engine_copy, TrtBuildSettings(half="fp16", graphs=("target",)), isolate=False, **QUIET)
    assert_unchanged(engine_copy, before)


def test_build_trt_commits_beside_the_graphs(engine_copy, monkeypatch):
    import dspark_export.engine_dir.trt_build as trt
    from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt

    monkeypatch.setattr(trt, "build_engine_file", _fake_trt_build())
    build_trt(engine_copy, TrtBuildSettings(kv_layouts=("capacity", "growing"), graphs=("target",), half="fp16"),
              isolate=False, **QUIET)
    m = load_manifest(engine_copy, rehash=True)
    assert set(m.trt_engines) == {"target.capacity.fp16", "target.fp16"} and not stage_dirs(engine_copy)
    assert not (engine_copy / ".dspark-verified.json").exists()  # hash records go to the user's cache
    # the capacity graph references the growing graph's weights, now beside it
    import onnx

    g = onnx.load(str(engine_copy / "target.capacity.onnx"), load_external_data=False)
    locations = {e.value for t in g.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"target.onnx.data"}
    onnx.load(str(engine_copy / "target.capacity.fp16.onnx"))  # its own weights, found under the final name


# -- a real full disk (a small tmpfs; needs root and mount)


@pytest.fixture()
def small_disk(tmp_path):
    """mount(size) -> a fresh tmpfs of ``size`` bytes; unmounted afterwards."""
    mounts = []

    def mount(size: int) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a small tmpfs needs root; the injected-ENOSPC tests cover the full disk instead")
        d = tmp_path / f"disk{len(mounts)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(size + 4095) // 4096 * 4}k", "tmpfs", str(d)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the injected-ENOSPC tests cover it")
        mounts.append(d)
        return d

    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _du(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def _fill(d: Path) -> None:
    """Write to the tmpfs ``d`` until it is full."""
    try:
        with open(d / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC


def test_full_disk_rebuild_and_profile_on_a_tmpfs(tiny_engine_dir, tiny_pair, small_disk):
    from dspark_export.engine_dir.build import build_engine
    from dspark_export.fit.cost_profile import profile_engine

    disk = small_disk(4 * _du(tiny_engine_dir))
    eng = disk / "eng"
    shutil.copytree(tiny_engine_dir, eng)
    before = snapshot(eng)
    # a rebuild needs room for a second engine beside the first: leave room for half of one
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / "pad").write_bytes(b"\0" * max(0, free - _du(eng) // 2))
    with pytest.raises(Exception) as ei:
        build_engine(_recipe(tiny_pair), eng, isolate=False, **QUIET)
    assert "No space left" in str(ei.value) or "no space left" in str(ei.value)
    assert_unchanged(eng, before)
    # no room at all: profile measures, then cannot write its table
    _fill(disk)
    with pytest.raises(DSparkError, match="no space left on the device"):
        profile_engine(eng, max_tokens=2, context=16, repeats=1, threads=1, probe_rows=False)
    assert_unchanged(eng, before)
    load_manifest(eng, rehash=True)


# -- a read-only engine directory: hashed once, then trusted from the user's cache


@pytest.fixture()
def read_only_engine(tiny_engine_dir, tmp_path):
    """(read-only view of an engine, writable path of the same files). As root (which ignores permissions) a
    read-only bind mount (a mounted image); else the directory chmod'ed read-only."""
    src = tmp_path / "src"
    shutil.copytree(tiny_engine_dir, src)
    if os.geteuid() == 0:
        view = tmp_path / "ro"
        view.mkdir()
        r = subprocess.run(["mount", "--bind", str(src), str(view)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"running as root (which ignores file permissions) and cannot bind-mount read-only: {r.stderr}")
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["umount", str(view)])
            pytest.skip(f"running as root and cannot remount read-only: {r.stderr}")
        yield view, src
        subprocess.run(["umount", "-l", str(view)], capture_output=True)
    else:
        for p in [src, *src.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
        yield src, src
        for p in [src, *src.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)


def _writable(p: Path):
    """Make file ``p`` (and its folder) writable for the block (a no-op under a bind mount's writable source)."""
    from contextlib import contextmanager

    @contextmanager
    def cm():
        modes = [(q, q.stat().st_mode) for q in (p.parent, p)]
        for q, m in modes:
            q.chmod(m | 0o200)
        try:
            yield
        finally:
            for q, m in reversed(modes):
                q.chmod(m)
    return cm()


def test_read_only_engine_is_hashed_once(read_only_engine, monkeypatch, private_cache):
    import dspark_runtime.engine_dir.integrity as integrity
    from dspark_runtime.engine import Engine

    view, src = read_only_engine
    with pytest.raises(OSError):
        (view / "probe").write_text("x")  # really read-only
    calls = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: calls.append(Path(p).name) or real(p, *a, **k))
    n = len(load_manifest(view, verify=False).all_files())
    Engine.load(view, threads=1)
    assert len(calls) == n  # the first load hashes every file
    calls.clear()
    Engine.load(view, threads=1)
    assert calls == []  # the second trusts the records in the user's cache
    assert any(private_cache.rglob("*.json"))
    # `dspark verify` still re-hashes everything
    load_manifest(view, rehash=True)
    assert len(calls) == n
    calls.clear()
    # a touched file (same bytes, new mtime) is hashed again, and passes
    p = src / "draft.onnx.data"
    st = p.stat()
    with _writable(p):
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    load_manifest(view)
    assert calls == ["draft.onnx.data"]
    calls.clear()
    # a modified file of the same size is hashed again and refused
    p = src / "target.onnx.data"
    raw = bytearray(p.read_bytes())
    raw[100] ^= 0xFF
    with _writable(p):
        p.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match="target.onnx.data is corrupted"):
        Engine.load(view, threads=1)
    assert "target.onnx.data" in calls
    calls.clear()
    with pytest.raises(ManifestError, match="target.onnx.data is corrupted"):  # and stays refused
        load_manifest(view)
    # an unwritable cache only costs hashing again: loads still work
    monkeypatch.setenv("DSPARK_CACHE", "/dev/null/cache")
    raw[100] ^= 0xFF
    with _writable(p):
        p.write_bytes(bytes(raw))
    load_manifest(view)
    load_manifest(view)


def test_a_read_only_engine_refuses_changes_clearly(read_only_engine):
    from dspark_export.fit.cost_profile import profile_engine

    view, _ = read_only_engine
    before = snapshot(view)
    with pytest.raises(DSparkError, match="must be writable"):
        profile_engine(view, max_tokens=2, context=16, repeats=1, threads=1, probe_rows=False)
    assert_unchanged(view, before)


def test_unpacked_engine_holds_only_its_files_and_loads_without_hashing(tiny_engine_dir, tmp_path, monkeypatch):
    import dspark_runtime.engine_dir.integrity as integrity
    from dspark_runtime.engine_dir.artifact import pack, unpack

    pack(tiny_engine_dir, tmp_path / "t.tar.gz")
    d = unpack(tmp_path / "t.tar.gz", tmp_path / "u")
    m = load_manifest(d, verify=False)
    assert {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} == \
        {"manifest.json"} | {f.path for f in m.all_files()}  # no hash sidecar in the engine directory
    calls = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    load_manifest(d)
    assert calls == []  # unpack hashed every file already
