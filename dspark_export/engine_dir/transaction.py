"""Transactional changes to an engine directory: all of a command's changes, or none of them.

Every command that changes a built engine directory in place (``build`` over an existing directory, ``add-draft``,
``profile``, ``calibrate``, ``build-trt``, ``build-cuda``) writes its new files into a stage (``.dspark-txn-*``
inside the directory, under their final relative names) and calls :meth:`EngineTransaction.commit`, whose commit
point is the atomic replacement of ``manifest.json``. Invariants: any error before it (an exception, Ctrl-C, a full
disk) leaves the directory exactly as it was; only deletions follow it; a command killed during a commit leaves a
journal from which the next transaction rolls back or finishes; one transaction at a time per directory (``flock``).
``quantize`` writes a new directory and needs none of this. Usage::

    with engine_transaction(engine_dir) as txn:
        export_something(txn.stage / "draft.onnx")
        manifest.graphs["draft"] = GraphEntry(..., files=[FileEntry.of(txn.stage, "draft.onnx"), ...])
        txn.commit(manifest)
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from dspark_runtime.engine_dir.integrity import VERIFIED_NAME, fsync_dir, record_verified
from dspark_runtime.engine_dir.manifest import MANIFEST_NAME, Manifest, parse_manifest
from dspark_runtime.errors import DSparkError

STAGE_PREFIX = ".dspark-txn-"
JOURNAL_NAME = ".journal.json"  # in the stage, from the start of a commit
BACKUP_NAME = ".replaced"  # in the stage: the versions the commit replaced, until the commit point passed
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class EngineTransaction:
    """One pending change of ``engine_dir``; made by :func:`engine_transaction`.

    ``stage``: the folder to write new files into, under the relative names they will have in the engine
    directory. Files the committed manifest lists are moved from there into place; other files only when
    registered with :meth:`add`.
    """

    def __init__(self, engine_dir: Path, stage: Path, old_files: set):
        self.engine_dir = engine_dir
        self.stage = stage
        self._old_files = old_files
        self._extras: list = []
        self._links: set = set()
        self.committed = False
        self.keep_stage = False  # a failed rollback: the stage holds files the next transaction restores

    def add(self, rel: str) -> Path:
        """Register ``rel`` (a file that is not listed in the manifest, e.g. ``calibration.json``) to be moved
        into place at commit; returns its path in the stage (parent folders created)."""
        p = self.stage / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if rel not in self._extras:
            self._extras.append(rel)
        return p

    def link(self, rel: str) -> Path:
        """Make the existing engine file ``rel`` visible in the stage (a hard link, or a copy where the
        filesystem has none), so that new files can be written beside it and read with it (an ONNX graph
        whose external weight file is ``rel``). Linked files are never moved back. Returns the stage path.

        Raises DSparkError when ``rel`` is not a file of the engine directory.
        """
        src, dst = self.engine_dir / rel, self.stage / rel
        if not src.is_file():
            raise DSparkError(f"{src} is missing; rebuild the engine")
        if rel in self._links:
            return dst
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        self._links.add(rel)
        return dst

    def commit(self, manifest: Manifest) -> None:
        """Move the new files into place and replace the manifest by ``manifest`` (the commit point); then
        delete replaced and superseded files. Call it once, last, inside the ``with`` block.

        The new files are fsynced first; each file they replace is moved aside into the stage; a journal in the
        stage records the moves, and a Ctrl-C during them is held until they are done or undone. The manifest is
        then written atomically (:meth:`Manifest.write`). After that only deletions follow — the replaced versions,
        the files the old manifest listed and the new one does not, a legacy hash sidecar, the stage — and the new
        files are recorded as hashed (:func:`dspark_runtime.engine_dir.integrity.record_verified`).

        Raises DSparkError when ``manifest`` lists a file that is neither in the stage nor in the engine
        directory; OSError (or KeyboardInterrupt) when a move or the manifest write fails — in every such case
        the engine directory is back as it was.
        """
        if self.committed:
            raise DSparkError("internal error: engine transaction committed twice")
        ed, st = self.engine_dir, self.stage
        listed = list(dict.fromkeys(f.path for f in manifest.all_files()))
        moves = [rel for rel in dict.fromkeys(listed + self._extras)
                 if rel not in self._links and (st / rel).is_file() and not (st / rel).is_symlink()]
        missing = [rel for rel in listed if rel not in moves and not (ed / rel).is_file()]
        if missing:
            raise DSparkError(f"internal error: the new manifest of {ed} lists {', '.join(missing)}, which the "
                              "command did not write; nothing was changed, please report this")
        text = manifest.text()
        plan = [{"rel": rel, "had": (ed / rel).is_file() or (ed / rel).is_symlink()} for rel in moves]
        for rel in moves:  # data on disk before the manifest that names it
            _fsync_file(st / rel)
        new_dirs = []  # folders the moves will create (relative), outermost first
        for rel in moves:
            for parent in reversed(Path(rel).parents[:-1]):  # "a/b/c" -> a, a/b
                if not (ed / parent).exists() and parent.as_posix() not in new_dirs:
                    new_dirs.append(parent.as_posix())
        journal = {"engine_dir": str(ed), "manifest_sha256": hashlib.sha256(text.encode()).hexdigest(),
                   "moves": plan, "new_dirs": new_dirs}
        with open(st / JOURNAL_NAME, "w") as f:
            json.dump(journal, f)
            f.flush()
            os.fsync(f.fileno())
        done: list = []  # (entry, new file moved in)
        made_dirs: list = []
        with _sigint_held() as interrupted:
            try:
                for e in plan:
                    rel = e["rel"]
                    dst = ed / rel
                    made_dirs += _makedirs(dst.parent, ed)
                    if e["had"]:
                        backup = st / BACKUP_NAME / rel
                        backup.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(dst, backup)
                    done.append([e, False])
                    os.replace(st / rel, dst)
                    done[-1][1] = True
                if interrupted():
                    raise KeyboardInterrupt
                manifest.write(ed)  # the commit point: atomic
            except BaseException:
                self.keep_stage = not _undo(ed, st, done, made_dirs)
                raise
            self.committed = True
            # after the commit point: only deletions, and a failure there leaves a valid engine
            superseded = (self._old_files - set(listed) - set(self._extras)) | {VERIFIED_NAME}
            for rel in sorted(superseded):
                p = ed / rel
                if p.is_file() or p.is_symlink():
                    try:
                        p.unlink()
                    except OSError as exc:
                        print(f"warning: could not delete the superseded file {p} ({exc}); delete it by hand",
                              file=sys.stderr)
            shutil.rmtree(st, ignore_errors=True)
            fsync_dir(ed)
            moved = set(moves)
            record_verified(ed, [f for f in manifest.all_files() if f.path in moved])  # hashed by the command


def _fsync_file(p: Path) -> None:
    with open(p, "rb") as f:
        os.fsync(f.fileno())


def _makedirs(d: Path, root: Path) -> list:
    """mkdir -p ``d`` (inside ``root``); returns the folders it created, outermost first."""
    made = []
    while not d.exists() and d != root and root in d.parents:
        made.append(d)
        d = d.parent
    made.reverse()
    for m in made:
        m.mkdir()
    return made


def _undo(ed: Path, st: Path, done: list, made_dirs: list) -> bool:
    """Roll back the moves ``done`` (newest first) and remove the folders the commit created. Returns False
    when a file could not be put back (it then stays in the stage, whose journal lets the next transaction
    finish the rollback)."""
    ok = True
    for e, moved_in in reversed(done):
        rel = e["rel"]
        try:
            if moved_in:
                os.replace(ed / rel, st / rel)
            if e["had"]:
                os.replace(st / BACKUP_NAME / rel, ed / rel)
        except OSError as exc:
            ok = False
            print(f"error: could not restore {ed / rel} ({exc}); the previous version is kept in {st}, and the next "
                  "dspark-export command on this directory puts it back", file=sys.stderr)
    for d in reversed(made_dirs):
        try:
            d.rmdir()
        except OSError:
            pass
    return ok


def _discard(txn, created: list) -> None:
    """Remove an uncommitted transaction's stage folder (``txn`` None: none to remove) and the directories the
    transaction created (innermost first, only if empty)."""
    if txn is not None:
        shutil.rmtree(txn.stage, ignore_errors=True)
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            pass


@contextmanager
def _sigint_held():
    """Hold SIGINT (Ctrl-C) while the block runs (main thread only); yields ``interrupted()``. A held Ctrl-C
    is raised as KeyboardInterrupt when the block ends."""
    hits: list = []
    old = None
    if threading.current_thread() is threading.main_thread():
        try:
            old = signal.signal(signal.SIGINT, lambda *a: hits.append(1))
        except (ValueError, TypeError):
            old = None
    try:
        yield lambda: bool(hits)
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    if hits:
        raise KeyboardInterrupt


def _recover(ed: Path, stage: Path) -> None:
    """Finish or roll back the change a killed command left in ``stage`` (see the module docstring)."""
    jp = stage / JOURNAL_NAME
    try:
        journal = json.loads(jp.read_text()) if jp.is_file() else None
    except (OSError, ValueError):
        journal = None
    if journal is not None:
        try:
            current = hashlib.sha256((ed / MANIFEST_NAME).read_bytes()).hexdigest()
        except OSError:
            current = None
        if current != journal.get("manifest_sha256"):  # not committed: put the replaced files back
            for e in reversed(journal.get("moves", [])):
                rel = e["rel"]
                backup = stage / BACKUP_NAME / rel
                if e.get("had") and backup.is_file():
                    os.replace(backup, ed / rel)
                elif not e.get("had") and not (stage / rel).exists() and (ed / rel).is_file():
                    (ed / rel).unlink()
            for d in reversed(journal.get("new_dirs", [])):
                try:
                    (ed / d).rmdir()
                except OSError:
                    pass
            print(f"note: rolled back an interrupted change of {ed} (left by a command that was killed)",
                  file=sys.stderr)
    for tmp in ed.glob(f".{MANIFEST_NAME}.*.tmp"):  # a manifest write the kill cut short
        tmp.unlink(missing_ok=True)
    shutil.rmtree(stage)


def _old_files(ed: Path) -> set:
    """The files the current manifest of ``ed`` lists (empty when there is none or it is unreadable)."""
    try:
        return {f.path for f in parse_manifest(json.loads((ed / MANIFEST_NAME).read_text())).all_files()}
    except Exception:  # noqa: BLE001 - a broken manifest is replaced, whatever is wrong with it
        return set()


def _no_space(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextmanager
def engine_transaction(engine_dir):
    """Change ``engine_dir`` all at once or not at all (see the module docstring); yields an
    :class:`EngineTransaction`. The directory (and missing parents) is created when it does not exist, and
    removed again when the transaction does not commit. Leaving the block without :meth:`~EngineTransaction.commit`
    changes nothing.

    Raises DSparkError when the directory cannot be written (read-only mount, permissions), when another
    command is changing it, or when the disk is full (the directory is then unchanged); re-raises any
    other error of the block after undoing everything.
    """
    ed = Path(engine_dir).absolute()
    if ed.exists() and not ed.is_dir():
        raise DSparkError(f"{ed} is a file, not an engine directory; pass a directory")
    created = _makedirs(ed, Path(ed.anchor)) if not ed.exists() else []
    lock_fd = None
    txn = None
    try:
        try:
            lock_fd = os.open(ed, os.O_RDONLY)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DSparkError(f"another dspark-export command is changing {ed}; wait for it to finish and run this "
                              "one again") from None
        except OSError:
            pass  # no locks on this filesystem: go on unlocked
        for stale in sorted(ed.glob(STAGE_PREFIX + "*")):
            if stale.is_dir():
                _recover(ed, stale)
        try:
            stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=ed))
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise
            raise DSparkError(f"cannot change {ed}: {exc.strerror or exc}; the engine directory must be writable "
                              "(copy it to a writable place with `cp -a` and run the command there)") from exc
        txn = EngineTransaction(ed, stage, _old_files(ed))
        yield txn
    except BaseException as exc:
        _discard(txn if txn is not None and not txn.committed and not txn.keep_stage else None, created)
        if not isinstance(exc, DSparkError) and _no_space(exc):
            raise DSparkError(f"no space left on the device of {ed} ({exc}); the engine directory was left as it "
                              "was. Free space there (the command writes its new files beside the old ones before "
                              "replacing them) or write the engine to a larger disk") from exc
        raise
    else:
        if not txn.committed:
            _discard(txn, created)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
