#!/usr/bin/env bash
# The Python packages the CUDA GPU check needs beyond the GPU machine's image (Python 3.12 with torch, numpy, onnx,
# cuda-python and the NVIDIA CUDA 13 / cuDNN 9 pip libraries): onnxruntime-gpu 1.31.1, onnxruntime-genai-cuda 0.18.0
# and polygraphy, laid out as `pip install --target` would, trimmed (the TensorRT provider library, onnxruntime's
# transformer model exporters, the debug symbols of the genai library) and packed as one xz archive (x86 filter +
# LZMA2 9e) in parts of at most 48 MiB: a device call carries 64 MiB, the repository's tracked tree included.
#
#   bash scripts/gpu_site_pack.sh            # -> .carry/site.tar.xz.part00.., .carry/site.sha256 (whole, then parts)
#   python3 scripts/gpu_site_unpack.py STAGE /tmp/site   # on the GPU machine, after the parts were carried to STAGE
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUTDIR=${OUTDIR:-.carry}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PKGS=("onnxruntime-gpu==1.31.1" "onnxruntime-genai-cuda==0.18.0" "polygraphy==0.53.6")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WORK/wheels" "${PKGS[@]}"
mkdir -p "$WORK/site"
for w in "$WORK"/wheels/*.whl; do "$PY" -m zipfile -e "$w" "$WORK/site"; done
S="$WORK/site"
rm -f "$S"/onnxruntime/capi/libonnxruntime_providers_tensorrt.so
rm -rf "$S"/onnxruntime/transformers/models
rm -f "$S"/onnxruntime/transformers/{convert_generation,onnx_exporter,benchmark}.py
strip --strip-debug "$S"/onnxruntime_genai/libonnxruntime-genai.so 2>/dev/null || true
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/site.tar.xz.part* "$OUTDIR"/site.sha256
"$PY" - "$S" "$OUTDIR" <<'PYEOF'
import hashlib, lzma, os, sys, tarfile
src, outdir = sys.argv[1], sys.argv[2]
part_bytes = 48 << 20
arc = os.path.join(outdir, "site.tar.xz")
filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]

def norm(ti):
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti

paths = []
for root, dirs, files in os.walk(src):
    dirs.sort()
    paths += [os.path.join(root, d) for d in dirs] + [os.path.join(root, f) for f in sorted(files)]
with lzma.LZMAFile(arc, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters) as xz:
    with tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for p in paths:
            tf.add(p, arcname=os.path.relpath(p, src), recursive=False, filter=norm)
whole, lines = hashlib.sha256(), []
with open(arc, "rb") as f:
    for i, b in enumerate(iter(lambda: f.read(part_bytes), b"")):
        whole.update(b)
        name = f"site.tar.xz.part{i:02d}"
        with open(os.path.join(outdir, name), "wb") as g:
            g.write(b)
        lines.append(f"{hashlib.sha256(b).hexdigest()}  {name}")
os.remove(arc)
with open(os.path.join(outdir, "site.sha256"), "w") as g:
    g.write(f"{whole.hexdigest()}  site.tar.xz\n" + "\n".join(lines) + "\n")
print(f"{len(lines)} parts, sha256 {whole.hexdigest()}")
PYEOF
