"""The engine directory's files on disk: durable writes (:func:`atomic_write_text`: a reader or a crash sees the old
content or the new, never a mix), sha256 (:func:`sha256_file`), and :func:`verify_files`, which checks every file a
manifest lists (present, right size, right sha256).

Trusted hashes: a file hashed once (at build, at load, by ``dspark verify``) is recorded in the user's cache
(:func:`trusted_records_path`, under :func:`cache_root`) with its real path, size, mtime (ns) and sha256; a later
check trusts it without hashing while all four still match. Nothing is written into the engine directory, so a
read-only one is hashed once; a replaced or modified file changes size or mtime and is hashed again; ``rehash=True``
(``dspark verify``, ``pack``) hashes everything. The record cache is best effort: unwritable means hashing again.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dspark_runtime.errors import ManifestError

# The sidecar of trusted hashes that earlier versions wrote into the engine directory. No longer read or
# written (records live in the user's cache, see trusted_records_path); a committed change of the engine
# directory (dspark_export.engine_dir.transaction) deletes a stale one.
VERIFIED_NAME = ".dspark-verified.json"
TRUSTED_DIR = "verified"  # under cache_root(): one JSON file of trusted-hash records per engine directory


def cache_root() -> Path:
    """Root of the DSpark cache: ``$DSPARK_CACHE`` when set, else ``~/.cache/dspark``."""
    env = os.environ.get("DSPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text`` so that readers (and a crash) see the old or the new
    content, never a mix: write a temporary file in the same directory, fsync it, ``os.replace`` it over
    ``path``, fsync the directory.

    Raises OSError (e.g. ENOSPC, EROFS) when the temporary file cannot be written or renamed; ``path`` is
    then unchanged and the temporary file removed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(d: Path) -> None:
    """fsync directory ``d`` (makes renames in it durable); a filesystem that cannot is ignored."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path, on_progress=None, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks; ``on_progress(nbytes)`` after each chunk."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
            if on_progress is not None:
                on_progress(len(b))
    return h.hexdigest()


def trusted_records_path(engine_dir: Path) -> Path:
    """The cache file of trusted-hash records for ``engine_dir``:
    ``<cache_root()>/verified/<sha256 of the directory's real path, 32 hex digits>.json``."""
    key = hashlib.sha256(os.path.realpath(engine_dir).encode()).hexdigest()[:32]
    return cache_root() / TRUSTED_DIR / f"{key}.json"


def _file_key(p: Path) -> str:
    return os.path.realpath(p)


def _read_records(engine_dir: Path) -> dict:
    """{absolute file path: [size, mtime_ns, sha256]} recorded for ``engine_dir`` ({} when none/unreadable)."""
    try:
        d = json.loads(trusted_records_path(engine_dir).read_text())
        files = d.get("files", {}) if isinstance(d, dict) else {}
        return {k: v for k, v in files.items() if isinstance(v, list) and len(v) == 3}
    except (OSError, ValueError):
        return {}


def _write_records(engine_dir: Path, records: dict) -> None:
    """Store ``records`` for ``engine_dir`` (atomically) and drop the record files of engine directories that
    no longer exist. Best effort: an unwritable cache only means hashing again next time."""
    p = trusted_records_path(engine_dir)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, json.dumps({"engine_dir": os.path.realpath(engine_dir), "files": records}))
    except OSError:
        return
    try:
        for other in p.parent.glob("*.json"):
            if other == p:
                continue
            try:
                d = json.loads(other.read_text())
                gone = not Path(d["engine_dir"]).is_dir()
            except (OSError, ValueError, KeyError, TypeError):
                gone = True
            if gone:
                other.unlink(missing_ok=True)
    except OSError:
        pass


def record_verified(engine_dir: Path, files) -> None:
    """Record the files ``files`` (FileEntry list, paths relative to ``engine_dir``) as hashed just now with
    their manifest sha256, at their current size and mtime, so the next load need not hash them again.

    Call it only for files whose content was hashed (or written and hashed) by the caller. Files that are
    missing or whose size differs from the entry are skipped. Never raises for an unwritable cache.
    """
    engine_dir = Path(engine_dir)
    records = _read_records(engine_dir)
    for f in files:
        p = engine_dir / f.path
        try:
            st = p.stat()
        except OSError:
            continue
        if st.st_size == f.size:
            records[_file_key(p)] = [st.st_size, st.st_mtime_ns, f.sha256]
    _write_records(engine_dir, records)


def verify_files(engine_dir: Path, manifest, rehash: bool = False, record: bool = True) -> None:
    """Check every file ``manifest`` (a :class:`~dspark_runtime.engine_dir.manifest.Manifest`) lists: present, right
    size and right sha256.

    A file recorded in the user's cache (:func:`trusted_records_path`) with its current absolute path, size,
    mtime and the manifest's sha256 is trusted without hashing, unless ``rehash``. Files hashed here are
    recorded (``record``; best effort, nothing is written into ``engine_dir``). Raises ManifestError naming
    the file and the fix.
    """
    engine_dir = Path(engine_dir)
    seen = _read_records(engine_dir)
    records = dict(seen)
    changed = False
    try:
        keys = set()
        for f in manifest.all_files():
            p = engine_dir / f.path
            if not p.is_file():
                raise ManifestError(f"{p} is missing (listed in the manifest); rebuild or re-unpack the engine")
            st = p.stat()
            if st.st_size != f.size:
                raise ManifestError(f"{p} has {st.st_size} bytes but the manifest says {f.size}: the file is "
                                    "truncated or corrupted; rebuild or re-unpack the engine")
            key = _file_key(p)
            keys.add(key)
            rec = [st.st_size, st.st_mtime_ns, f.sha256]
            if not rehash and seen.get(key) == rec:
                continue
            digest = sha256_file(p)
            if digest != f.sha256:
                changed |= records.pop(key, None) is not None
                raise ManifestError(f"{p} is corrupted: sha256 {digest[:16]}… does not match the manifest's "
                                    f"{f.sha256[:16]}…; rebuild or re-unpack the engine")
            changed |= records.get(key) != rec
            records[key] = rec
        stale = set(records) - keys  # files the manifest no longer lists
        for k in stale:
            del records[k]
        changed |= bool(stale)
    finally:
        if record and changed:  # also when a file failed: keep what was checked before it
            _write_records(engine_dir, records)
