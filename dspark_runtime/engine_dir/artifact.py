"""Engine artifacts: one checksummed tarball per engine directory (``dspark-export pack``), unpacked by
``dspark unpack`` or loaded directly (``Engine.load("x.tar.gz")``). Artifacts are published (CI job,
release page), never committed.

Checksums: the manifest inside lists every file with its sha256; ``pack`` re-hashes them all before
writing (a corrupted engine is never published) and ``unpack`` re-hashes them all after extracting (a
corrupted or tampered download is refused before anything runs). ``pack`` also writes ``<tarball>.sha256``
(``sha256sum`` format) for the tarball itself; ``unpack`` checks it when it lies beside the tarball.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from dspark_runtime.engine_dir.integrity import cache_root, record_verified, sha256_file, verify_files
from dspark_runtime.engine_dir.manifest import MANIFEST_NAME, load_manifest, parse_manifest
from dspark_runtime.errors import ManifestError

TARBALL_SUFFIXES = (".tar.gz", ".tgz")


def is_tarball(path: str | Path) -> bool:
    """True when ``path`` names an engine tarball (by suffix; it need not exist)."""
    return str(path).endswith(TARBALL_SUFFIXES)


def pack(engine_dir: str | Path, out: str | Path, compresslevel: int = 1) -> dict:
    """Write ``engine_dir`` (its manifest and every file the manifest lists, nothing else) to the gzip
    tarball ``out`` and ``out.sha256``.

    compresslevel: gzip level 1..9 (1: weights barely compress, and level 1 is several times faster).
    Returns ``{"path", "sha256", "bytes", "files"}``. Raises ManifestError when a listed file is missing
    or does not match its sha256 (every file is re-hashed), DSparkError-derived errors for a bad ``out``.
    """
    engine_dir, out = Path(engine_dir), Path(out)
    if not is_tarball(out):
        raise ManifestError(f"{out}: name the tarball *.tar.gz or *.tgz")
    manifest = load_manifest(engine_dir, verify=True, rehash=True)
    names = [MANIFEST_NAME] + sorted({f.path for f in manifest.all_files()})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    root = manifest.name

    def _clean(ti: tarfile.TarInfo) -> tarfile.TarInfo:  # reproducible metadata
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mode = 0o644 if ti.isfile() else 0o755
        return ti

    with tarfile.open(tmp, "w:gz", compresslevel=compresslevel) as tar:
        for n in names:
            tar.add(engine_dir / n, arcname=f"{root}/{n}", recursive=False, filter=_clean)
    digest = sha256_file(tmp)
    os.replace(tmp, out)
    Path(str(out) + ".sha256").write_text(f"{digest}  {out.name}\n")
    return {"path": str(out), "sha256": digest, "bytes": out.stat().st_size, "files": len(names)}


def _read_manifest_member(tar: tarfile.TarFile, where: str) -> tuple[str, dict]:
    for m in tar:
        parts = Path(m.name).parts
        if len(parts) == 2 and parts[1] == MANIFEST_NAME and m.isfile():
            try:
                return parts[0], json.loads(tar.extractfile(m).read())
            except ValueError as e:
                raise ManifestError(f"{where}: its {MANIFEST_NAME} is not valid JSON ({e}); download it again")
    raise ManifestError(f"{where} holds no <name>/{MANIFEST_NAME}: not a DSpark engine tarball "
                        "(make one with `dspark-export pack`)")


def unpack(tarball: str | Path, dest: str | Path, check_sidecar: bool = True) -> Path:
    """Extract the engine tarball into ``dest/<name>`` and verify every file against the manifest's sha256.
    Returns the engine directory.

    Only the manifest and the files it lists are extracted (regular files, relative paths inside
    ``<name>/``); anything else in the tarball is an error. Extraction goes to a temporary directory
    beside the target, which replaces ``dest/<name>`` only after every checksum matched.
    Raises ManifestError naming the file when a checksum (or the ``.sha256`` sidecar) does not match,
    a file is missing, or the tarball is not an engine tarball.
    """
    tarball, dest = Path(tarball), Path(dest)
    if not tarball.is_file():
        raise ManifestError(f"engine tarball {tarball} does not exist")
    side = Path(str(tarball) + ".sha256")
    if check_sidecar and side.is_file():
        want = side.read_text().split()[0]
        got = sha256_file(tarball)
        if got != want:
            raise ManifestError(f"{tarball} does not match its checksum file {side.name} (sha256 {got[:16]}… vs "
                                f"{want[:16]}…): the download is corrupted or tampered with; download it again")
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            root, d = _read_manifest_member(tar, str(tarball))
            manifest = parse_manifest(d, f"{tarball}:{root}/{MANIFEST_NAME}")
            allowed = {MANIFEST_NAME} | {f.path for f in manifest.all_files()}
            members = []
            for m in tar.getmembers():
                rel = Path(m.name)
                if m.isdir():
                    continue
                inner = Path(*rel.parts[1:]) if len(rel.parts) > 1 else None
                if (not m.isfile() or rel.is_absolute() or ".." in rel.parts or rel.parts[0] != root
                        or inner is None or inner.as_posix() not in allowed):
                    raise ManifestError(f"{tarball}: member {m.name!r} is not a file the manifest lists; refusing to "
                                        "unpack it (rebuild the tarball with `dspark-export pack`)")
                members.append((m, inner))
            dest.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=f".{root}.", dir=dest))
            try:
                for m, inner in members:
                    target = work / inner
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(m) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 22)
                verify_files(work, manifest, rehash=True, record=False)
                final = dest / root
                if final.exists():
                    shutil.rmtree(final)
                os.replace(work, final)
                record_verified(final, manifest.all_files())  # hashed just now: the first load need not
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ManifestError(f"{tarball} is not a readable gzip tarball ({e}); download it again") from e
    return final


def unpacked_dir(tarball: str | Path, cache: str | Path | None = None) -> Path:
    """The engine directory of ``tarball`` in the cache (``$DSPARK_CACHE/engines/<key>/<name>``, default cache
    ``~/.cache/dspark``; the key hashes the tarball's path, size and mtime, so a replaced tarball unpacks
    afresh), unpacking and verifying it on first use. Returns the engine directory."""
    tarball = Path(tarball)
    if not tarball.is_file():
        raise ManifestError(f"engine tarball {tarball} does not exist")
    root = Path(cache or cache_root()) / "engines"
    h = hashlib.sha256()
    st = tarball.stat()
    h.update(f"{tarball.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    dest = root / h.hexdigest()[:16]
    done = dest / ".unpacked"
    if done.is_file():
        return Path(done.read_text())
    engine = unpack(tarball, dest)
    done.write_text(str(engine))
    return engine
