"""Compile DSpark's custom-op library (:data:`dspark_runtime.kernels.SOURCE`) into ``libdspark_kernels.so``:
:func:`build_kernels`, cached under ``<cache>/kernels/<digest>/`` by the digest of the source, the compiler and the
headers, so an engine build compiles it once per machine (about ten seconds).

Needs a C++17 compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) and ONNX Runtime's C/C++ API headers, which
the ``onnxruntime`` wheel does not ship: ``$DSPARK_ORT_INCLUDE`` names a folder holding ``onnxruntime_cxx_api.h``
(an ONNX Runtime release's ``include/``), else Debian's ``libonnxruntime-dev`` package (the 1.21 API, which every
later runtime serves) is downloaded once, checked against its SHA-256 and unpacked into ``<cache>/ort-headers/``.
Linux x86-64 only; every failure raises :class:`~dspark_runtime.errors.DSparkError` naming the fix.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from dspark_runtime.errors import DSparkError
from dspark_runtime.kernels import LIBRARY_NAME, SOURCE

from dspark_export.paths import cache_root

INCLUDE_ENV = "DSPARK_ORT_INCLUDE"
HEADERS_DEB = "libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
HEADERS_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
HEADERS_URLS = (f"http://deb.debian.org/debian/pool/main/o/onnxruntime/{HEADERS_DEB}",
                f"https://snapshot.debian.org/archive/debian/20250401T000000Z/pool/main/o/onnxruntime/{HEADERS_DEB}")
FLAGS = ["-std=c++17", "-O3", "-fPIC", "-shared", "-fvisibility=hidden"]
_NO_KERNELS = "or build the engine with --int4-source gguf-compact, which needs no kernels of ours"


def find_compiler() -> str:
    """The C++ compiler to use: ``$CXX``, else the first of c++, g++, clang++ on PATH."""
    for c in ([os.environ["CXX"]] if os.environ.get("CXX") else []) + ["c++", "g++", "clang++"]:
        found = shutil.which(c)
        if found:
            return found
    raise DSparkError("building DSpark's kernels needs a C++17 compiler and none was found ($CXX, c++, g++, "
                      f"clang++): install one (Debian/Ubuntu: `apt install g++`), {_NO_KERNELS}")


def ort_include_dir(log=print) -> Path:
    """A folder holding ONNX Runtime's ``onnxruntime_cxx_api.h``: ``$DSPARK_ORT_INCLUDE``, else the cached headers
    of Debian's ``libonnxruntime-dev``, downloaded and checked on first use."""
    env = os.environ.get(INCLUDE_ENV)
    if env:
        d = Path(env).expanduser()
        if not (d / "onnxruntime_cxx_api.h").is_file():
            raise DSparkError(f"${INCLUDE_ENV}={env} has no onnxruntime_cxx_api.h; point it at ONNX Runtime's "
                              "include folder, or unset it to download the headers")
        return d
    d = cache_root() / "ort-headers" / HEADERS_SHA256[:16]
    if (d / "onnxruntime_cxx_api.h").is_file():
        return d
    data, errors = None, []
    for url in HEADERS_URLS:
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                data = r.read()
            break
        except OSError as e:
            errors.append(f"{url}: {e}")
    if data is None:
        raise DSparkError("could not download ONNX Runtime's headers (" + "; ".join(errors) + f"); put an ONNX "
                          f"Runtime release's include/ folder in ${INCLUDE_ENV}, {_NO_KERNELS}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != HEADERS_SHA256:
        raise DSparkError(f"{HEADERS_DEB} downloaded with SHA-256 {digest}, expected {HEADERS_SHA256}; retry, or "
                          f"set ${INCLUDE_ENV}")
    headers = _deb_headers(data)
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial.", dir=d.parent))
    for name, body in headers.items():
        (tmp / name).write_bytes(body)
    try:
        tmp.rename(d)
    except OSError:  # another build unpacked them first
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"  ONNX Runtime headers from {HEADERS_DEB} -> {d}")
    return d


def _deb_headers(deb: bytes) -> dict:
    """{file name: bytes} of the ``usr/include/onnxruntime/*.h`` files in a Debian package (an ar archive holding
    ``data.tar.*``)."""
    if not deb.startswith(b"!<arch>\n"):
        raise DSparkError(f"{HEADERS_DEB} is not a Debian package")
    pos, members = 8, {}
    while pos + 60 <= len(deb):
        name = deb[pos:pos + 16].decode().strip().rstrip("/")
        size = int(deb[pos + 48:pos + 58].decode().strip())
        members[name] = deb[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    data = next((v for k, v in members.items() if k.startswith("data.tar")), None)
    if data is None:
        raise DSparkError(f"{HEADERS_DEB} has no data archive")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            p = Path(m.name)
            if m.isfile() and p.parent.name == "onnxruntime" and p.suffix == ".h" and "include" in p.parts:
                out[p.name] = tar.extractfile(m).read()
    if "onnxruntime_cxx_api.h" not in out:
        raise DSparkError(f"{HEADERS_DEB} holds no onnxruntime_cxx_api.h")
    return out


def build_kernels(log=print) -> Path:
    """The compiled library for this machine's compiler: built on first use, then taken from the cache. Returns
    its path. Raises DSparkError without a compiler or headers, or when compiling fails (with the compiler's
    last lines)."""
    cxx = find_compiler()
    include = ort_include_dir(log=log)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in [cxx, *version, *FLAGS, (include / "onnxruntime_c_api.h").read_text(errors="replace")]:
        h.update(part.encode())
    out = cache_root() / "kernels" / h.hexdigest()[:16] / LIBRARY_NAME
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.partial")
    cmd = [cxx, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        tmp.unlink(missing_ok=True)
        raise DSparkError(f"compiling DSpark's kernels failed ({' '.join(cmd)}):\n{tail}\nUse a C++17 compiler with "
                          f"AVX-512 intrinsics (g++ >= 9, clang++ >= 10), {_NO_KERNELS}")
    tmp.replace(out)
    log(f"  DSpark kernels compiled -> {out}")
    return out
