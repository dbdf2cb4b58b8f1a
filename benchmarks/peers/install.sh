#!/usr/bin/env bash
# Install the peers benchmarks.compare measures DSpark against, each into its own virtual environment
# under the peer folder (never a project dependency; the project's .venv is not touched).
#
#   benchmarks/peers/install.sh llama-cpp        llama-cpp-python built from its PyPI sdist (CPU, native) +
#                                                llama.cpp's own llama-speculative / llama-tokenize binaries
#                                                built from the same sdist's vendored llama.cpp
#   benchmarks/peers/install.sh ort-genai        onnxruntime-genai (CPU wheel) + what its model builder needs
#   benchmarks/peers/install.sh ort-genai-model [MODEL]
#                                                runs the ort-genai model builder (int4, cpu) on the converted
#                                                HF folder of MODEL (default qwen2.5-coder-1.5b-instruct)
#   benchmarks/peers/install.sh openvino         openvino-genai + optimum-intel[openvino] (its exporter) on a CPU
#                                                torch (TORCH_INDEX first); a torchvision that does not fit it removed
#   benchmarks/peers/install.sh openvino-model [MODEL...]
#                                                `optimum-cli export openvino --task text-generation-with-past
#                                                --weight-format int4` (its defaults otherwise) of the converted HF
#                                                folder of each MODEL (default: the 1.5B target and the 0.5B draft,
#                                                qwen2.5-coder-{1.5b,0.5b}-instruct); waits for OV_EXPORT_MIN_GB
#   benchmarks/peers/install.sh all              llama-cpp, ort-genai, ort-genai-model, openvino and openvino-model
#
# Idempotent: a step whose result is in place (its `installed.json`) is skipped; FORCE=1 redoes it.
# Each step records its wall time and peak RSS (/usr/bin/time -v) in that installed.json.
#
# Environment:
#   DSPARK_CACHE      cache root (default ~/.cache/dspark); DSPARK_PEER_DIR overrides <cache>/peers
#   LLAMA_CPP_PYTHON_VERSION (default 0.3.36), ORT_GENAI_VERSION (default 0.18.0)
#   OPENVINO_GENAI_VERSION (default 2026.4.1.0), OPTIMUM_INTEL_VERSION (default 2.2.0), TORCH_VERSION (2.13.0)
#   TORCH_INDEX       the CPU torch wheel index (default https://download.pytorch.org/whl/cpu); when unreachable,
#                     pip's configured sources (the project .venv's torch came from those)
#   OV_EXPORT_MIN_GB  GiB of MemAvailable the openvino export waits for (default 12; polled every 60 s for up to
#                     MEM_WAIT_S, default 1800)
#   JOBS              parallel compile jobs (default 2); builds run under `nice -n 10`
#   PYTHON            the interpreter the venvs are made from (default python3)
#   TRANSFORMERS_VERSION  for ort-genai (default: the project .venv's transformers, else 5.24.0)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${DSPARK_CACHE:-$HOME/.cache/dspark}"
PEERS="${DSPARK_PEER_DIR:-$CACHE/peers}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ORT_GENAI_VERSION="${ORT_GENAI_VERSION:-0.18.0}"
OPENVINO_GENAI_VERSION="${OPENVINO_GENAI_VERSION:-2026.4.1.0}"
OPTIMUM_INTEL_VERSION="${OPTIMUM_INTEL_VERSION:-2.2.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
OV_EXPORT_MIN_GB="${OV_EXPORT_MIN_GB:-12}"
MEM_WAIT_S="${MEM_WAIT_S:-1800}"
FORCE="${FORCE:-0}"

log() { echo "[peers] $*" >&2; }
die() { echo "[peers] error: $*" >&2; exit 1; }

usage() {
    sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

# timed STEPFILE CMD...: run CMD under /usr/bin/time -v (nice'd), append "wall_s peak_rss_kb" to STEPFILE
timed() {
    local rec="$1"; shift
    local tv; tv="$(mktemp)"
    if [ -x /usr/bin/time ]; then
        nice -n 10 /usr/bin/time -v -o "$tv" "$@"
        local wall rss
        wall="$(awk -F': ' '/Elapsed \(wall clock\)/{print $2}' "$tv")"
        rss="$(awk -F': ' '/Maximum resident set size/{print $2}' "$tv")"
        echo "$wall $rss" >>"$rec"
        log "  took $wall (h:mm:ss / m:ss), peak RSS $((rss / 1024)) MiB"
    else
        local t0; t0="$(date +%s)"
        nice -n 10 "$@"
        echo "$(( $(date +%s) - t0 ))s ?" >>"$rec"
    fi
    rm -f "$tv"
}

installed() {  # installed DIR NAME: FORCE unset and DIR/installed.json present: says so and prints it
    if [ "$FORCE" != 1 ] && [ -f "$1/installed.json" ]; then
        log "$2: already installed in $1 (FORCE=1 to redo):"
        cat "$1/installed.json"
        return 0
    fi
    return 1
}

make_venv() {  # make_venv DIR
    if [ ! -x "$1/bin/python" ]; then
        log "creating venv $1"
        "$PYTHON" -m venv "$1" || die "could not create a venv with $PYTHON (Debian/Ubuntu: apt-get install python3-venv)"
    fi
}

need_tools() {  # compilers and cmake for the native builds
    local missing=()
    for t in cc c++ make; do command -v "$t" >/dev/null || missing+=("$t"); done
    if [ "${#missing[@]}" -gt 0 ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            log "installing build-essential (missing: ${missing[*]})"
            apt-get update -qq && apt-get install -y -qq build-essential >/dev/null
        else
            die "missing ${missing[*]}: install a C/C++ toolchain (Debian/Ubuntu: apt-get install build-essential)"
        fi
    fi
    if ! command -v cmake >/dev/null; then
        log "no cmake on PATH: pip-installing cmake into $PEERS/.tools"
        make_venv "$PEERS/.tools"
        "$PEERS/.tools/bin/pip" install -q cmake
        export PATH="$PEERS/.tools/bin:$PATH"
    fi
}

# ---------------------------------------------------------------------------------------------------
# llama-cpp

# ggml's AMX kernels crashed ("Illegal instruction") on AMX CPUs with a native build. Explicit -mno-* flags
# win over -march=native wherever they stand on the command line (gcc: -mno-amx-* before
# -march=sapphirerapids leaves __AMX_INT8__ undefined), so CFLAGS/CMAKE_C_FLAGS are enough.
# CPUINFO overrides /proc/cpuinfo (tests).
amx_flags() {
    if grep -qwE 'amx_tile|amx_int8|amx_bf16' "${CPUINFO:-/proc/cpuinfo}" 2>/dev/null; then
        echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    fi
}

install_llama_cpp() {
    local P="$PEERS/llama-cpp"
    if [ -x "$P/bin/llama-speculative" ] && "$P/venv/bin/python" -c "import llama_cpp" 2>/dev/null \
        && installed "$P" llama-cpp; then return 0; fi
    need_tools
    mkdir -p "$P/src" "$P/bin"
    make_venv "$P/venv"
    local sdist="$P/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        log "llama-cpp: downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
        "$P/venv/bin/pip" download -q --no-binary :all: --no-deps -d "$P/src" \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    fi
    local noamx; noamx="$(amx_flags)"
    [ -n "$noamx" ] && log "llama-cpp: CPU has AMX: building with $noamx"
    local rec="$P/.times"; : >"$rec"
    # 1. the Python binding, built from the sdist (CPU only, -march=native, no BLAS, no multimodal lib)
    local cmake_args="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release"
    log "llama-cpp: pip install llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION from the sdist (CMAKE_ARGS=$cmake_args; a native build, ~10 min on 2 cores)"
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" CFLAGS="$noamx" CXXFLAGS="$noamx" \
        timed "$rec" "$P/venv/bin/pip" install -q --no-binary llama-cpp-python "$sdist"
    # 2. llama.cpp's own binaries from the same vendored source (static, so they need nothing beside them)
    local src="$P/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
    [ -d "$src/vendor/llama.cpp" ] || tar xzf "$sdist" -C "$P/src"
    log "llama-cpp: cmake build of llama-speculative and llama-tokenize from $src/vendor/llama.cpp"
    local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
    cmake -S "$src/vendor/llama.cpp" -B "$P/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DGGML_BLAS=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
        -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" >"$P/cmake-configure.log" 2>&1 \
        || { tail -30 "$P/cmake-configure.log"; die "cmake configure failed (log: $P/cmake-configure.log)"; }
    timed "$rec" cmake --build "$P/build" -j "$JOBS" --target llama-speculative llama-tokenize
    cp "$P/build/bin/llama-speculative" "$P/build/bin/llama-tokenize" "$P/bin/"
    local pyver binver commit
    pyver="$("$P/venv/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')"
    binver="$("$P/bin/llama-speculative" --version 2>&1 | grep -m1 -i 'version' || true)"
    commit="$(git -C "$src/vendor/llama.cpp" rev-parse HEAD 2>/dev/null || echo unknown)"
    local t1 t2
    t1="$(sed -n 1p "$rec")"; t2="$(sed -n 2p "$rec")"
    cat >"$P/installed.json" <<EOF
{
 "peer": "llama-cpp",
 "llama_cpp_python": "$pyver",
 "llama_cpp_commit": "$commit",
 "binary_version": "$binver",
 "python": "$P/venv/bin/python",
 "binaries": ["$P/bin/llama-speculative", "$P/bin/llama-tokenize"],
 "cmake_args": "$cmake_args",
 "extra_cflags": "$noamx",
 "pip_build": {"wall": "${t1% *}", "peak_rss_kb": "${t1#* }"},
 "binary_build": {"wall": "${t2% *}", "peak_rss_kb": "${t2#* }"},
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
EOF
    rm -rf "$P/build"  # ~100 MB of objects; the binaries are static
    log "llama-cpp: installed llama-cpp-python $pyver (llama.cpp $commit; $binver)"
    cat "$P/installed.json"
}

# ---------------------------------------------------------------------------------------------------
# ort-genai

project_transformers() {
    if [ -n "${TRANSFORMERS_VERSION:-}" ]; then echo "$TRANSFORMERS_VERSION"; return; fi
    if [ -x "$ROOT/.venv/bin/python" ]; then
        "$ROOT/.venv/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null && return
    fi
    echo "5.24.0"
}

install_ort_genai() {
    local P="$PEERS/ort-genai"
    if "$P/venv/bin/python" -c "import onnxruntime_genai" 2>/dev/null && installed "$P" ort-genai; then return 0; fi
    mkdir -p "$P"
    make_venv "$P/venv"
    local tv; tv="$(project_transformers)"
    local rec="$P/.times"; : >"$rec"
    # torch pinned exactly as in the project (a looser pin pulls a multi-GB CUDA build); the builder
    # imports torch + transformers to read the HF checkpoint, onnx/onnx-ir to write the graph
    log "ort-genai: pip install onnxruntime-genai==$ORT_GENAI_VERSION torch==2.13.0 transformers==$tv onnx onnx-ir onnxruntime"
    timed "$rec" "$P/venv/bin/pip" install -q "onnxruntime-genai==$ORT_GENAI_VERSION" "torch==2.13.0" \
        "transformers==$tv" onnx onnx-ir onnxruntime safetensors
    local vers
    vers="$("$P/venv/bin/python" - <<'EOF'
import json, importlib.metadata as md
print(json.dumps({k: md.version(k) for k in ("onnxruntime-genai", "onnxruntime", "torch", "transformers", "onnx", "onnx-ir")}))
EOF
)"
    case "$vers" in *'"torch": "2.13.0+cpu"'*|*'"torch": "2.13.0"'*) ;; *) log "WARNING: unexpected torch build: $vers";; esac
    local t1; t1="$(sed -n 1p "$rec")"
    cat >"$P/installed.json" <<EOF
{
 "peer": "ort-genai",
 "versions": $vers,
 "python": "$P/venv/bin/python",
 "pip_install": {"wall": "${t1% *}", "peak_rss_kb": "${t1#* }"},
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
EOF
    log "ort-genai: installed $vers"
    cat "$P/installed.json"
}

hf_folder() {  # the converted HF folder of a fetched model (dspark_export.models.fetch.model_path)
    if [ -d "$1" ]; then (cd "$1" && pwd); return; fi
    local d="$CACHE/models/$1"
    if [ -x "$ROOT/.venv/bin/python" ]; then
        d="$(cd "$ROOT" && DSPARK_CACHE="$CACHE" .venv/bin/python -c \
            'import sys; from dspark_export.models.fetch import model_path; print(model_path(sys.argv[1]))' "$1" 2>/dev/null || echo "$d")"
    fi
    echo "$d"
}

build_ort_genai_model() {
    local model="${1:-qwen2.5-coder-1.5b-instruct}"
    local P="$PEERS/ort-genai"
    [ -x "$P/venv/bin/python" ] || die "ort-genai is not installed: run $0 ort-genai first"
    local src; src="$(hf_folder "$model")"
    [ -f "$src/config.json" ] || die "no converted HF folder for $model at $src: run \`dspark-export fetch $model\` first"
    local name; name="$(basename "$src")"
    local out="$P/models/$name-int4"
    if [ "$FORCE" != 1 ] && [ -f "$out/built.json" ] && [ -f "$out/genai_config.json" ]; then
        log "ort-genai-model: $out already built (FORCE=1 to redo):"
        cat "$out/built.json"
        return 0
    fi
    local avail; avail="$(awk '/MemAvailable/{print int($2/1048576)}' /proc/meminfo)"
    log "ort-genai-model: building $out from $src (int4, cpu; the builder holds the fp32 checkpoint in memory; ${avail} GiB available now)"
    rm -rf "$out"; mkdir -p "$P/models" "$P/hf-cache"
    local rec="$P/.model-times"; : >"$rec"
    OMP_NUM_THREADS="$JOBS" TQDM_DISABLE=1 HF_HUB_OFFLINE=1 timed "$rec" "$P/venv/bin/python" \
        -m onnxruntime_genai.models.builder -m "$src" -o "$out" -p int4 -e cpu -c "$P/hf-cache" 2>&1 \
        | tee "$P/models/$name-int4.build.log" | grep -v 'matmul_nbits_quantizer' | tail -5 || true
    [ -f "$out/genai_config.json" ] || die "the builder wrote no genai_config.json (log: $P/models/$name-int4.build.log)"
    local t1 bytes
    t1="$(sed -n 1p "$rec")"
    bytes="$(du -sb "$out" | cut -f1)"
    cat >"$out/built.json" <<EOF
{
 "source": "$src",
 "command": "python -m onnxruntime_genai.models.builder -m $src -o $out -p int4 -e cpu -c $P/hf-cache",
 "onnxruntime_genai": "$("$P/venv/bin/python" -c 'import onnxruntime_genai as og; print(og.__version__)')",
 "wall": "${t1% *}",
 "peak_rss_kb": "${t1#* }",
 "bytes": $bytes,
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
EOF
    log "ort-genai-model: built $out ($((bytes / 1048576)) MiB)"
    cat "$out/built.json"
}

# ---------------------------------------------------------------------------------------------------
# openvino

reachable() {  # reachable URL: the URL answers within 20 s (with $PYTHON: no curl needed)
    "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=20)' "$1" >/dev/null 2>&1
}

install_openvino() {
    local P="$PEERS/openvino"
    if "$P/venv/bin/python" -c "import openvino_genai" 2>/dev/null && installed "$P" openvino; then return 0; fi
    mkdir -p "$P"
    make_venv "$P/venv"
    local rec="$P/.times"; : >"$rec"
    # 1. a CPU torch first (optimum-intel's exporter traces the model with torch; left to pip's resolver it
    #    pulls the multi-GB CUDA build)
    local torch_src
    if reachable "$TORCH_INDEX/torch/"; then
        torch_src="$TORCH_INDEX"
        log "openvino: pip install torch==$TORCH_VERSION --index-url $TORCH_INDEX"
        timed "$rec" "$P/venv/bin/pip" install -q "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX"
    else
        torch_src="pip's configured sources ($TORCH_INDEX unreachable)"
        log "openvino: $TORCH_INDEX is unreachable: pip install torch==$TORCH_VERSION from pip's configured sources"
        timed "$rec" "$P/venv/bin/pip" install -q "torch==$TORCH_VERSION"
    fi
    local torch_v torch_cuda
    torch_v="$("$P/venv/bin/python" -c 'import torch; print(torch.__version__)')"
    torch_cuda="$("$P/venv/bin/python" -c 'import torch; print(torch.version.cuda or "")')"
    [ -z "$torch_cuda" ] || log "WARNING: torch $torch_v is a CUDA $torch_cuda build (GBs of CUDA libraries): set" \
        "TORCH_INDEX to a reachable CPU wheel index, or PIP_FIND_LINKS to a folder holding the +cpu wheel, and FORCE=1"
    # 2. the runtime and the exporter, torch pinned to the build just installed
    log "openvino: pip install openvino-genai==$OPENVINO_GENAI_VERSION" \
        "optimum-intel[openvino]==$OPTIMUM_INTEL_VERSION (torch==$torch_v kept)"
    timed "$rec" "$P/venv/bin/pip" install -q "openvino-genai==$OPENVINO_GENAI_VERSION" \
        "optimum-intel[openvino]==$OPTIMUM_INTEL_VERSION" "torch==$torch_v"
    # 3. a torchvision built for another torch breaks `import transformers` (its image processors import it)
    local removed=""
    if "$P/venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torchvision") is None)'; then
        local tvv; tvv="$("$P/venv/bin/python" -c 'import importlib.metadata as md; print(md.version("torchvision"))')"
        if ! "$P/venv/bin/python" -c "$TORCHVISION_FITS" 2>/dev/null; then
            log "openvino: torchvision $tvv does not fit torch $torch_v: uninstalled"
            "$P/venv/bin/pip" uninstall -q -y torchvision
            removed="torchvision $tvv"
        fi
    fi
    "$P/venv/bin/python" -c "import openvino_genai, optimum.intel, transformers" \
        || die "openvino: the venv does not import openvino_genai / optimum.intel / transformers (FORCE=1 to redo)"
    local vers
    vers="$("$P/venv/bin/python" -c 'import json, importlib.metadata as md
names = ("openvino-genai", "openvino", "openvino-tokenizers", "optimum-intel", "optimum", "nncf", "torch",
         "transformers")
print(json.dumps({k: md.version(k) for k in names}))')"
    local t1 t2
    t1="$(sed -n 1p "$rec")"; t2="$(sed -n 2p "$rec")"
    cat >"$P/installed.json" <<EOF
{
 "peer": "openvino",
 "versions": $vers,
 "python": "$P/venv/bin/python",
 "torch_source": "$torch_src",
 "removed": "$removed",
 "torch_install": {"wall": "${t1% *}", "peak_rss_kb": "${t1#* }"},
 "pip_install": {"wall": "${t2% *}", "peak_rss_kb": "${t2#* }"},
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
EOF
    log "openvino: installed $vers"
    cat "$P/installed.json"
}

# exit 0 when torchvision imports against this torch and its torch pin (if any) names this torch's version
TORCHVISION_FITS='import importlib.metadata as md, re, sys
import torch, torchvision  # raises when its operators do not register against this torch
pins = [m.group(1) for r in (md.requires("torchvision") or [])
        for m in [re.match(r"torch\s*\(?\s*==\s*([^\s;,)]+)", r)] if m]
sys.exit(any(p.split("+")[0] != torch.__version__.split("+")[0] for p in pins))'

# {"versions", "quantization_config" (openvino_config.json), "bitwidth" (NNCF's table: compression mode -> "% of all
# parameters (layers)")} of an export folder and its log; a package that is not installed: null
EXPORT_INFO='import json, sys, importlib.metadata as md
from pathlib import Path
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
cfg = Path(sys.argv[1]) / "openvino_config.json"
q = json.loads(cfg.read_text()).get("quantization_config") if cfg.is_file() else None
lines = Path(sys.argv[2]).read_text(errors="replace").splitlines()
rows = [[c.strip() for c in l.strip().strip("\u2502").split("\u2502")] for l in lines if l.startswith("\u2502")]
bits = {r[0]: r[1] for r in rows if len(r) >= 2 and not r[0].startswith("Weight compression")}
names = ("optimum-intel", "openvino", "nncf", "openvino-tokenizers", "torch", "transformers")
print(json.dumps({"versions": {k: version(k) for k in names}, "quantization_config": q, "bitwidth": bits}))'

mem_available_gib() {  # MemAvailable in whole GiB (free -g's "available"); MEMINFO overrides /proc/meminfo (tests)
    awk '/MemAvailable/{print int($2/1048576)}' "${MEMINFO:-/proc/meminfo}"
}

# wait_for_memory GIB WHAT: poll every MEM_POLL_S (60) s until GIB are available, MEM_WAIT_S at most, else fail
wait_for_memory() {
    local need="$1" what="$2" waited=0 avail poll="${MEM_POLL_S:-60}"
    while :; do
        avail="$(mem_available_gib)"
        [ "$avail" -ge "$need" ] && return 0
        [ "$waited" -ge "$MEM_WAIT_S" ] && die "$what needs $need GiB of available memory, $avail GiB after waiting" \
            "$waited s: let the other jobs finish, or set MEM_WAIT_S longer (OV_EXPORT_MIN_GB lower at your own risk)"
        log "$what: $avail GiB available, waiting for $need GiB (${waited}/${MEM_WAIT_S} s)"
        sleep "$poll"
        waited=$((waited + poll))
    done
}

build_openvino_model() {  # build_openvino_model [MODEL...]: default the 1.5B target and the 0.5B draft
    local P="$PEERS/openvino"
    [ -x "$P/venv/bin/optimum-cli" ] || die "openvino is not installed: run $0 openvino first"
    local models=("$@")
    [ "${#models[@]}" -gt 0 ] || models=(qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct)
    local model src name out avail rec log_file t1 bytes info
    for model in "${models[@]}"; do
        src="$(hf_folder "$model")"
        [ -f "$src/config.json" ] \
            || die "no converted HF folder for $model at $src: run \`dspark-export fetch $model\` first"
        name="$(basename "$src")"
        out="$P/models/$name-int4"
        if [ "$FORCE" != 1 ] && [ -f "$out/built.json" ] && [ -f "$out/openvino_model.xml" ]; then
            log "openvino-model: $out already exported (FORCE=1 to redo):"
            cat "$out/built.json"
            continue
        fi
        # the export holds the fp32 checkpoint, the traced model and the compressed copy at once
        wait_for_memory "$OV_EXPORT_MIN_GB" "openvino-model ($name)"
        avail="$(mem_available_gib)"
        # --task: what optimum infers for a hub model id of this architecture; it infers none for a local folder
        local cmd=(optimum-cli export openvino --model "$src" --task text-generation-with-past
                   --weight-format int4 "$out")
        log "openvino-model: ${cmd[*]} (${avail} GiB available now; log $P/models/$name-int4.export.log)"
        rm -rf "$out"; mkdir -p "$P/models"
        rec="$P/.model-times"; : >"$rec"
        log_file="$P/models/$name-int4.export.log"
        PATH="$P/venv/bin:$PATH" OMP_NUM_THREADS="$JOBS" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
            timed "$rec" "$P/venv/bin/${cmd[0]}" "${cmd[@]:1}" >"$log_file" 2>&1 || true
        [ -f "$out/openvino_model.xml" ] \
            || { tail -20 "$log_file" >&2; die "the export wrote no openvino_model.xml (log: $log_file)"; }
        t1="$(sed -n 1p "$rec")"
        bytes="$(du -sb "$out" | cut -f1)"
        # what the export chose by default (optimum-intel's openvino_config.json and NNCF's bitwidth table in the
        # log) and the versions that made it
        info="$("$P/venv/bin/python" -c "$EXPORT_INFO" "$out" "$log_file")"
        log "  took ${t1% *}, peak RSS $(( ${t1#* } / 1024 )) MiB, $((bytes / 1048576)) MiB written"
        cat >"$out/built.json" <<EOF
{
 "source": "$src",
 "command": "${cmd[*]}",
 "export": $info,
 "wall": "${t1% *}",
 "peak_rss_kb": "${t1#* }",
 "mem_available_gib_at_start": $avail,
 "bytes": $bytes,
 "date": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
EOF
        log "openvino-model: exported $out"
        cat "$out/built.json"
    done
}

# ---------------------------------------------------------------------------------------------------

[ $# -ge 1 ] || usage
mkdir -p "$PEERS"
case "$1" in
    llama-cpp) install_llama_cpp ;;
    ort-genai) install_ort_genai ;;
    ort-genai-model) build_ort_genai_model "${2:-}" ;;
    openvino) install_openvino ;;
    openvino-model) shift; build_openvino_model "$@" ;;
    all) install_llama_cpp; install_ort_genai; build_ort_genai_model "${2:-}"; install_openvino
         build_openvino_model ${2:+"$2"} ;;
    -h|--help) usage ;;
    *) die "unknown peer '$1' (llama-cpp, ort-genai, ort-genai-model [MODEL], openvino," \
           "openvino-model [MODEL...], all)" ;;
esac
