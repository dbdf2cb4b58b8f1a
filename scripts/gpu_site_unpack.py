#!/usr/bin/env python3
"""Reassemble and unpack a carried site-packages archive (pure stdlib, Python >= 3.8).

    python3 scripts/gpu_site_unpack.py [STAGE [TARGET]] [--name site]

STAGE (default /tmp/stage) holds NAME.tar.xz.part00, part01, ... and the manifest NAME.sha256
(if the manifest is not in STAGE, .carry/NAME.sha256 next to this repository is used). The manifest's
first line is the sha256 of the whole archive, the others the sha256 of each part. The parts are
checked, then streamed in order through tarfile (xz) into TARGET (default /tmp/site) without writing
the whole archive to disk. Exits non-zero with one line on a missing/extra part or a mismatch.
Afterwards: export PYTHONPATH=TARGET:$PYTHONPATH PATH=TARGET/bin:$PATH
"""
import argparse
import hashlib
import io
import os
import sys
import tarfile
import time

BUF = 8 * 1024 * 1024


def fail(msg):
    print(f"gpu_site_unpack: {msg}", file=sys.stderr)
    sys.exit(1)


def read_manifest(stage, name):
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(stage, name + ".sha256"), os.path.join(here, "..", ".carry", name + ".sha256")):
        if os.path.isfile(cand):
            rows = [ln.split() for ln in open(cand) if ln.strip()]
            if not rows or any(len(r) != 2 for r in rows):
                fail(f"malformed manifest {cand}")
            return cand, rows[0][0], [(r[1], r[0]) for r in rows[1:]]
    fail(f"no manifest {name}.sha256 in {stage} or .carry/")


class Concat(io.RawIOBase):
    """read-only stream over the parts, in order"""

    def __init__(self, paths):
        self.paths, self.f = list(paths), None

    def readable(self):
        return True

    def readinto(self, b):
        while True:
            if self.f is None:
                if not self.paths:
                    return 0
                self.f = open(self.paths.pop(0), "rb")
            n = self.f.readinto(b)
            if n:
                return n
            self.f.close()
            self.f = None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stage", nargs="?", default="/tmp/stage")
    ap.add_argument("target", nargs="?", default="/tmp/site")
    ap.add_argument("--name", default="site", help="archive name (NAME.tar.xz.partNN, NAME.sha256)")
    a = ap.parse_args()

    t0 = time.time()
    mpath, whole_hex, parts = read_manifest(a.stage, a.name)
    present = sorted(f for f in os.listdir(a.stage) if f.startswith(a.name + ".tar.xz.part")) \
        if os.path.isdir(a.stage) else []
    missing = [p for p, _ in parts if p not in present]
    if missing:
        fail(f"missing part(s) in {a.stage}: {' '.join(missing)} (manifest {mpath} lists {len(parts)})")
    extra = [p for p in present if p not in {q for q, _ in parts}]
    if extra:
        fail(f"unexpected part(s) in {a.stage}: {' '.join(extra)}")

    whole, total = hashlib.sha256(), 0
    for p, want in parts:
        h = hashlib.sha256()
        with open(os.path.join(a.stage, p), "rb") as f:
            for b in iter(lambda: f.read(BUF), b""):
                h.update(b)
                whole.update(b)
                total += len(b)
        if h.hexdigest() != want:
            fail(f"sha256 mismatch for {p}: got {h.hexdigest()}, want {want}")
    if whole.hexdigest() != whole_hex:
        fail(f"sha256 mismatch for {a.name}.tar.xz: got {whole.hexdigest()}, want {whole_hex}")
    t1 = time.time()
    print(f"verified {len(parts)} part(s), {total} bytes ({total / 2**20:.1f} MiB), sha256 ok, {t1 - t0:.1f} s")

    os.makedirs(a.target, exist_ok=True)
    stream = io.BufferedReader(Concat(os.path.join(a.stage, p) for p, _ in parts), BUF)
    nfiles = nbytes = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|xz") as tf:
            for m in tf:
                kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tf.extract(m, a.target, **kw)
                if m.isfile():
                    nfiles += 1
                    nbytes += m.size
    except (tarfile.TarError, EOFError, OSError) as e:
        fail(f"extraction into {a.target} failed: {type(e).__name__}: {e}")
    t2 = time.time()
    print(f"extracted {nfiles} files, {nbytes} bytes ({nbytes / 2**20:.1f} MiB) into {a.target}, {t2 - t1:.1f} s "
          f"(total {t2 - t0:.1f} s)")
    print(f"use: export PYTHONPATH={a.target}:$PYTHONPATH PATH={a.target}/bin:$PATH")


if __name__ == "__main__":
    main()
