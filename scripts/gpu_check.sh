#!/usr/bin/env bash
# The runtime on an NVIDIA GPU, in prepared scripts (transcripts on stdout). Two paths:
#
# ONNX Runtime's CUDA provider (device-resident K/V, CUDA graphs; benchmarks/gpu/check_cuda.py):
#   bash scripts/gpu_check.sh --prepare-cuda  # on any machine with this repo's .venv: .carry/gpu-cuda/ <- tiny
#                                             #   engines with device graphs + the stripped 1.5B-architecture graph
#                                             #   (benchmarks/gpu/prepare_cuda.py); .carry/site.tar.xz.part* <- the
#                                             #   trimmed onnxruntime-gpu, onnxruntime-genai-cuda and polygraphy
#                                             #   (scripts/gpu_site_pack.sh), in <= 48 MiB parts for 64 MiB device calls
#   bash scripts/gpu_check.sh cuda [STAGE [--skip PHASES]]  # on the GPU machine (Python 3.12 with numpy, onnx, torch, transformers,
#                                             #   cuda-python): unpacks the parts found in STAGE (default /tmp/stage)
#                                             #   into /tmp/site, runs the check; results in $OUT (or ./gpu-check-out)
#
# TensorRT (benchmarks/gpu/check_trt.py):
#   bash scripts/gpu_check.sh --prepare       # on any machine with network (and this repo's .venv):
#                                             #   wheelhouse/ <- Python 3.12 wheels for the runtime + TensorRT,
#                                             #   engines/gpu-check-tiny/ <- a tiny engine (ONNX + TensorRT-RTX AOT engines)
#   bash scripts/gpu_check.sh trt             # on the GPU machine (Python 3.12, no network needed): installs from
#                                             #   wheelhouse/ into .venv-gpu/, runs benchmarks/gpu/check_trt.py
#
# A device call carries the working tree (tracked and untracked-not-ignored files) and at most 64 MiB in all; the
# shipped drafter checkpoint alone is 56 MiB and no check needs it. Around every device call:
#   bash scripts/gpu_check.sh --park          # before: moves it out of the tree ($DSPARK_PARK_DIR, default
#                                             #   ~/.cache/dspark/parked) and prints what would travel
#   bash scripts/gpu_check.sh --unpark        # after: moves it back (or restores it from git if the copy is gone)
# Never commit while it is parked (git sees it deleted). Both prepare steps print these two commands.
#
# Both folders are gitignored (artifacts never go into git). TensorRT flavour: TensorRT-RTX for compute capability
# 7.5/8.x/12.x; enterprise tensorrt for Hopper (9.0) and datacenter Blackwell (10.x), where TensorRT-RTX does not
# run (its wheels are then downloaded too, ~1-2 GB; set DSPARK_GPU_CHECK_ENTERPRISE=0 to skip them).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=wheelhouse
ENGINE=engines/gpu-check-tiny
RUNTIME_PKGS=("numpy>=1.26" "onnxruntime==1.32.*" "tokenizers>=0.21" "jinja2>=3.1" "click>=8.1" "onnx==1.23.*"
              "tensorrt-rtx-cu13-libs==1.7.1.116" "tensorrt-rtx-cu13-bindings==1.7.1.116" "cuda-python>=13.0,<14")
ENTERPRISE_PKGS=("tensorrt-cu13-libs==10.16.1.11" "tensorrt-cu13-bindings==10.16.1.11")
CHECKPOINT=engines/drafters/qwen2.5-coder-1.5b-dspark/model.safetensors
PARK=${DSPARK_PARK_DIR:-${DSPARK_CACHE:-$HOME/.cache/dspark}/parked}

travel_mib() {  # what a device call would carry: tracked files present + untracked files git does not ignore
  { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s -- 2>/dev/null \
    | awk '{s += $1} END {printf "%.1f", s / 1048576}'
}

park_note() {
  echo "== before a device call: bash scripts/gpu_check.sh --park   (moves $CHECKPOINT out of the tree;"
  echo "   the call carries at most 64 MiB: $(travel_mib) MiB of tracked and untracked files now, the checkpoint included)"
  echo "== after it: bash scripts/gpu_check.sh --unpark"
}

if [[ "${1:-}" == "--park" ]]; then
  if [[ -f "$CHECKPOINT" ]]; then
    mkdir -p "$PARK/$(dirname "$CHECKPOINT")"
    mv "$CHECKPOINT" "$PARK/$CHECKPOINT"
    echo "parked $CHECKPOINT in $PARK (bash scripts/gpu_check.sh --unpark puts it back; do not commit meanwhile)"
  else
    echo "$CHECKPOINT is not in the tree (already parked?)"
  fi
  CARRY=$( [[ -d .carry ]] && du -sb .carry | awk '{printf "%.1f", $1 / 1048576}' || echo 0)
  echo "a device call carries $(travel_mib) MiB of the working tree now, plus what it names in carry (.carry/: $CARRY MiB);"
  echo "64 MiB in all"
  exit 0
fi

if [[ "${1:-}" == "--unpark" ]]; then
  if [[ -f "$PARK/$CHECKPOINT" ]]; then
    mv "$PARK/$CHECKPOINT" "$CHECKPOINT"
    echo "restored $CHECKPOINT from $PARK"
  elif [[ ! -f "$CHECKPOINT" ]]; then
    git checkout -- "$CHECKPOINT" && echo "restored $CHECKPOINT from git (no parked copy in $PARK)"
  else
    echo "$CHECKPOINT is in place"
  fi
  exit 0
fi

if [[ "${1:-}" == "--prepare-cuda" ]]; then
  PY=${PY:-.venv/bin/python}
  nice -n 19 "$PY" -m benchmarks.gpu.prepare_cuda --out .carry/gpu-cuda
  bash scripts/gpu_site_pack.sh
  du -sh .carry/gpu-cuda .carry/site.tar.xz.part*
  park_note
  exit 0
fi

if [[ "${1:-}" == "cuda" ]]; then
  STAGE=${2:-/tmp/stage}
  OUTDIR=${OUT:-gpu-check-out}
  mkdir -p "$OUTDIR"
  PY=${PY:-python3}
  [[ -d /tmp/site/onnxruntime ]] || "$PY" scripts/gpu_site_unpack.py "$STAGE" /tmp/site || exit 2
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
  # the CUDA 13 / cuDNN 9 libraries of the NVIDIA pip packages beside torch (onnxruntime-gpu links them by soname)
  NV=$("$PY" -c "import nvidia; print(list(nvidia.__path__)[0])" 2>/dev/null || true)
  [[ -n "$NV" ]] && export LD_LIBRARY_PATH="$(ls -d "$NV"/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}"
  shift $(( $# >= 2 ? 2 : $# ))
  "$PY" -m benchmarks.gpu.check_cuda .carry/gpu-cuda --out "$OUTDIR/gpu-check-cuda.json" --deadline-s "${DEADLINE_S:-470}" "$@"
  exit $?
fi

[[ "${1:-}" == "trt" ]] && shift
if [[ "${1:-}" == "--prepare" ]]; then
  PY=${PY:-.venv/bin/python}
  mkdir -p "$WHEELS"
  nice -n 19 "$PY" -m pip download -q -d "$WHEELS" --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      "${RUNTIME_PKGS[@]}"
  if [[ "${DSPARK_GPU_CHECK_ENTERPRISE:-1}" == "1" ]]; then
    nice -n 19 "$PY" -m pip download -q -d "$WHEELS" --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "${ENTERPRISE_PKGS[@]}" \
      || echo "note: enterprise tensorrt wheels not downloaded; Hopper/datacenter Blackwell cannot be checked"
  fi
  # the tiny engine: random tiny Qwen2 target (features of layers -1, 0) + draft LM + an untrained DSpark drafter
  # (tests/fixtures/tiny_models.py), ONNX, then TensorRT-RTX AOT engines of all three graphs
  rm -rf "$ENGINE"
  nice -n 19 "$PY" - "$ENGINE" <<'PYEOF'
import sys, tempfile
from pathlib import Path
from tests.tiny_models import add_tiny_dspark, make_pair
from dspark_export.engine_dir.build import Recipe, build_engine
from dspark_export.engine_dir.trt_build import TrtBuildSettings, build_trt
from dspark_runtime.backends.trt.profiles import ProfileSettings
out = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    t, d = make_pair(Path(tmp))
    build_engine(Recipe(name="gpu-check-tiny", target=str(t), draft=str(d), target_feature_layers=[-1, 0],
                        draft_length=4), out, isolate=False)
    ckpt = add_tiny_dspark(out, t)  # graph "dspark"; its checkpoint folder is not needed afterwards
    import shutil; shutil.rmtree(ckpt)
# prefill_chunk 16: the drafter's first call on a 40-token prompt runs as three chunks (the path a long prompt takes);
# max_batch 4: check 5 decodes 4 requests in one DeviceBatchRunner
build_trt(out, TrtBuildSettings(profile=ProfileSettings(max_batch=4, decode_q=5, prefill_chunk=16, capacity=128,
                                                        min_bucket=32)), isolate=False)
PYEOF
  du -sh "$WHEELS" "$ENGINE"
  park_note
  exit 0
fi

echo "== $(date -u +%FT%TZ) $(uname -m) $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader)"
[[ -d "$WHEELS" && -d "$ENGINE" ]] || { echo "run 'bash scripts/gpu_check.sh --prepare' first"; exit 2; }
PY312=${PY312:-python3.12}
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
case "$CC" in
  7.5|8.0|8.6|8.7|8.9|12.*) FLAVOUR=rtx ;;
  *) FLAVOUR=enterprise ;;
esac
"$PY312" -m venv .venv-gpu
.venv-gpu/bin/pip install -q --no-index --find-links "$WHEELS" "${RUNTIME_PKGS[@]}"
if [[ $FLAVOUR == enterprise ]]; then
  .venv-gpu/bin/pip install -q --no-index --find-links "$WHEELS" "${ENTERPRISE_PKGS[@]}"
fi
echo "== compute capability $CC: TensorRT flavour $FLAVOUR"
# enterprise engines must be built on this GPU; RTX engines built ahead of time on a CPU are used as shipped
EXTRA=()
[[ $FLAVOUR == enterprise ]] && EXTRA=(--rebuild)
PYTHONPATH=. .venv-gpu/bin/python -m benchmarks.gpu.check_trt "$ENGINE" --flavour "$FLAVOUR" "${EXTRA[@]}"
