#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU, nvcc, CMake and Python 3.12, offline; or,
# with --backend vulkan, on any Vulkan device (glslc and the Vulkan headers instead of nvcc).
#
#   bash benchmarks/gpu/run.sh OUTDIR [--backend cuda|vulkan] [--with-llama-server]
#
# Run from a checkout that holds benchmarks/gpu/prepared/ (python benchmarks/gpu/prepare.py,
# on a machine with a package registry). One command, about 9 minutes at most, nothing cached:
#   1. a fresh venv (python3.12) with the prepared wheels (--no-index);
#   2. llama-cpp-python built from the trimmed sdist with CUDA (sm_90: H100/H200; set
#      CUDA_ARCH for another GPU) or Vulkan, and with --with-llama-server llama-server from the
#      same build tree (one ggml compile for both);
#   3. the engine (this checkout, --no-deps);
#   4. python -m pytest -q -m gpu tests/system/test_gpu.py  -> OUTDIR/gpu-tests.xml, gpu-tests.log;
#   5. benchmarks/gpu/figures.py                     -> OUTDIR/figures.json.
# Every stage has a timeout within the overall budget (GPU_CHECK_BUDGET_S, default 530 s;
# BUILD_LIMIT_S, default 360, and TESTS_LIMIT_S, default 180, for the two long stages);
# results are written as they come; OUTDIR/all.tar.gz bundles everything at the end.
# benchmarks/gpu/vulkan.sh runs these same steps on Mesa's lavapipe (a CPU-only machine).
# Exit status: 0 when the build, the install and the GPU tests passed (figures are best-effort).
set -uo pipefail

usage() { echo "usage: bash benchmarks/gpu/run.sh OUTDIR [--backend cuda|vulkan] [--with-llama-server]" >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
OUTDIR=$(realpath -m "$1"); shift
WITH_SERVER=0
BACKEND=cuda
while [[ $# -gt 0 ]]; do
  case $1 in
    --with-llama-server) WITH_SERVER=1 ;;
    --backend) [[ $# -ge 2 ]] || usage; BACKEND=$2; shift ;;
    --backend=*) BACKEND=${1#--backend=} ;;
    *) usage ;;
  esac
  shift
done
case $BACKEND in
  cuda | vulkan) ;;
  *) echo "run.sh: --backend must be cuda or vulkan, not '$BACKEND'" >&2; exit 2 ;;
esac

START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-530}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PREP=$REPO/benchmarks/gpu/prepared
CUDA_ARCH=${CUDA_ARCH:-90}
BUILD_LIMIT_S=${BUILD_LIMIT_S:-360}
TESTS_LIMIT_S=${TESTS_LIMIT_S:-180}
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
WORK=$(mktemp -d /tmp/hydra-gpu-check.XXXXXX)
VENV=$WORK/venv
mkdir -p "$OUTDIR/logs"
: >"$OUTDIR/stages.tsv"
exec > >(tee -a "$OUTDIR/run.log") 2>&1

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }

bundle() {
  # Everything in one file (a caller may fetch only a few files back).
  tar czf "$WORK/all.tar.gz" -C "$OUTDIR" --exclude=all.tar.gz . 2>/dev/null && mv "$WORK/all.tar.gz" "$OUTDIR/all.tar.gz"
}
trap 'echo "total $(elapsed) s"; bundle' EXIT

# stage NAME LIMIT_S CMD...: runs CMD with its output in OUTDIR/logs/NAME.log, under a timeout
# of LIMIT_S or the time left in the budget, whichever is less; a line per stage in stages.tsv.
stage() {
  local name=$1 limit=$2 rc t0
  shift 2
  local avail=$(( $(left) - 5 ))
  (( limit > avail )) && limit=$avail
  if (( limit < 10 )); then
    echo "=== $name: SKIPPED, out of time ($(elapsed) s used of $BUDGET_S)"
    printf '%s\tskipped\t0\n' "$name" >>"$OUTDIR/stages.tsv"
    return 124
  fi
  echo "=== $name (limit ${limit} s, at $(elapsed) s)"
  t0=$(date +%s)
  # bash -c: CMD may be one of the exported functions below
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$OUTDIR/logs/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >>"$OUTDIR/stages.tsv"
  if (( rc == 0 )); then
    echo "    ok in $(( $(date +%s) - t0 )) s"
  else
    echo "    FAILED rc=$rc after $(( $(date +%s) - t0 )) s$( ((rc == 124)) && echo ' (timed out)'); last lines:"
    tail -n 25 "$OUTDIR/logs/$name.log" | sed 's/^/    | /'
  fi
  return $rc
}

fail() { echo "GPU check stopped: $*"; exit 1; }

[[ -d $PREP/wheels ]] && compgen -G "$PREP/llama_cpp_python-*.tar.gz" >/dev/null \
  || fail "$PREP is missing: run python benchmarks/gpu/prepare.py on a machine with a package registry first"
SDIST=$(ls "$PREP"/llama_cpp_python-*.tar.gz | head -n 1)
export OUTDIR PREP WORK VENV SDIST BACKEND
echo "backend: $BACKEND"

# Tools: python3.12, nvcc (the CUDA toolkit's bin may be off the PATH) or glslc, cmake.
PY=${PYTHON:-}
for cand in python3.12 /usr/bin/python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
  [[ -n $PY ]] && break
  if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    PY=$(command -v "$cand")
  fi
done
[[ -n $PY ]] || fail "no Python 3.12 found (set PYTHON=/path/to/python3.12)"
export PY
# A rehearsal on a CPU machine (checks everything but CUDA), with a CPU wheel built earlier:
#   LLAMA_WHEEL=/path/llama_cpp_python-VER-py3-none-linux_x86_64.whl FIGURES_ARGS="--preset tiny --quick" \
#     bash benchmarks/gpu/run.sh /tmp/rehearsal
# LLAMA_WHEEL=path: install that llama-cpp-python wheel instead of building one (a rehearsal of
# this script on a CPU machine, or a wheel built earlier).
LLAMA_WHEEL=${LLAMA_WHEEL:-}
if [[ $BACKEND == cuda ]]; then
  command -v nvcc >/dev/null || export PATH=$PATH:/usr/local/cuda/bin
  if [[ -z $LLAMA_WHEEL ]]; then
    command -v nvcc >/dev/null || fail "nvcc not found (the CUDA toolkit is needed)"
    export CUDACXX=${CUDACXX:-$(command -v nvcc)}
  fi
  BACKEND_CMAKE="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
else
  if [[ -z $LLAMA_WHEEL ]]; then
    command -v glslc >/dev/null || fail "glslc not found (Debian/Ubuntu: apt-get install glslc)"
    [[ -f /usr/include/vulkan/vulkan.h || -n ${VULKAN_SDK:-} ]] \
      || fail "no Vulkan headers (Debian/Ubuntu: apt-get install libvulkan-dev spirv-headers)"
  fi
  BACKEND_CMAKE="-DGGML_VULKAN=on"
  # llama.cpp passes over CPU-type Vulkan devices (lavapipe, llvmpipe) unless they are named:
  # when no GPU-type device is listed, name the first CPU-type one.
  if [[ -z ${GGML_VK_VISIBLE_DEVICES:-} ]] && command -v vulkaninfo >/dev/null; then
    vk_types=$(vulkaninfo --summary 2>/dev/null | awk '/^GPU[0-9]+:/ {i=substr($1,4)+0} /deviceType/ {print i, $3}')
    if ! grep -qE 'DISCRETE_GPU|INTEGRATED_GPU|VIRTUAL_GPU' <<<"$vk_types"; then
      cpu_dev=$(awk '/TYPE_CPU/ {print $1; exit}' <<<"$vk_types")
      [[ -n $cpu_dev ]] && export GGML_VK_VISIBLE_DEVICES=$cpu_dev \
        && echo "no GPU-type Vulkan device: using the CPU-type device $cpu_dev (GGML_VK_VISIBLE_DEVICES=$cpu_dev)"
    fi
  fi
fi

env_report() {
  date -u; uname -a; nproc; free -g | head -2
  if [[ $BACKEND == cuda ]]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv || nvidia-smi -L
    nvcc --version | tail -n 2 || echo "nvcc: not on PATH"
  else
    vulkaninfo --summary 2>/dev/null | sed -n '/^Devices:/,$p' || echo "vulkaninfo: not on PATH"
    glslc --version | head -n 1 || echo "glslc: not on PATH"
    echo "GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-}"
  fi
  cmake --version | head -n 1 || echo "cmake: not on PATH"
  "$PY" --version; echo "python: $PY"; cat "$PREP/manifest.json" 2>/dev/null | head -n 12
}
export -f env_report
stage env 30 env_report
cat "$OUTDIR/logs/env.log"

make_venv() {
  if ! "$PY" -m venv "$VENV"; then
    # No ensurepip (a distribution's python without its venv package): bootstrap pip from
    # the prepared pip wheel (a wheel runs as a zip).
    rm -rf "$VENV"
    "$PY" -m venv --without-pip "$VENV" || return 1
    local pipwhl
    pipwhl=$(ls "$PREP"/wheels/pip-*.whl | head -n 1)
    "$VENV/bin/python" "$pipwhl/pip" install --no-index --no-compile --quiet "$pipwhl" || return 1
  fi
  "$VENV/bin/python" -m pip install --no-index --disable-pip-version-check --find-links "$PREP/wheels" \
    -r "$PREP/requirements.txt" -c "$PREP/constraints.txt"
}
export -f make_venv
stage venv 150 make_venv || fail "venv or wheel install failed (logs/venv.log)"
export PATH=$VENV/bin:$PATH
command -v cmake >/dev/null || { [[ -x /opt/torch/.venv/bin/cmake ]] && export PATH=$PATH:/opt/torch/.venv/bin; }
[[ -n $LLAMA_WHEEL ]] || command -v cmake >/dev/null || fail "cmake not found (prepare with --with-cmake to carry it)"

CMAKE_ARGS="$BACKEND_CMAKE -DLLAVA_BUILD=OFF"
if (( WITH_SERVER )); then
  # llama-server from the same tree and build folder: one ggml compile for both.
  CMAKE_ARGS+=" -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF"
fi
export CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
echo "CMAKE_ARGS=$CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL=$JOBS"
# LLAMA_BUILD_DIR=path keeps the CMake build folder there, and the sdist unpacked beside it
# (LLAMA_SRC_DIR; CMake's cache names its source folder): a rerun recompiles only what
# changed (the Vulkan lane on 2 cores). By default both are fresh ones under WORK.
BUILD_DIR=${LLAMA_BUILD_DIR:-$WORK/build}
SRC_DIR=${LLAMA_SRC_DIR:-${LLAMA_BUILD_DIR:+$LLAMA_BUILD_DIR-src}}
SRC_DIR=${SRC_DIR:-$WORK/src}
export BUILD_DIR SRC_DIR
unpack_sdist() {
  # The sdist unpacked (its files keep the archive's times: a kept build folder stays valid).
  python - "$SDIST" "$SRC_DIR" "$BACKEND" "${VULKAN_SDK:-}" <<'PYEOF'
import re, sys, tarfile
from pathlib import Path
sdist, dest, backend = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
root = dest / sdist.name.removesuffix(".tar.gz")
if not (root / "PKG-INFO").is_file():
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
print(root)
if backend != "vulkan":
    raise SystemExit(0)
# Vulkan headers older than VK_EXT_layer_settings (Debian 12's 1.3.239): ggml-vulkan sets the
# validation layer's best-practices switch through it, a debugging aid; without the
# extension the instance is made without that setting (the only code that needs it).
sdk = [f"{sys.argv[4]}/include"] if len(sys.argv) > 4 and sys.argv[4] else []
headers = [Path(p) / "vulkan" / "vulkan_core.h" for p in (*sdk, "/usr/include")]
if any(h.is_file() and "VK_EXT_layer_settings" in h.read_text() for h in headers):
    raise SystemExit(0)
src = root / "vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp"
text = src.read_text()
if "HYDRA_NO_LAYER_SETTINGS" in text:
    raise SystemExit(0)
pattern = re.compile(r"(\n(\s*)VkBool32 enable_best_practice = layer_settings;.*?\n(\s*)vk::InstanceCreateInfo instance_create_info\(([^;]*?), &layer_setting_info\);)", re.S)
m = pattern.search(text)
if m is None:
    raise SystemExit(f"{src}: the layer-settings block to guard was not found")
guarded = (f"\n#if defined(VK_EXT_layer_settings) // HYDRA_NO_LAYER_SETTINGS{m.group(1)}\n#else\n"
           f"{m.group(3)}vk::InstanceCreateInfo instance_create_info({m.group(4)});\n#endif")
src.write_text(text[: m.start()] + guarded + text[m.end():])
print(f"{src}: VK_EXT_layer_settings guarded (these Vulkan headers lack it)")
PYEOF
}
export -f unpack_sdist
build_llama() {
  local out root
  out=$(unpack_sdist) || { echo "$out"; return 1; }
  echo "$out"
  root=$(head -n 1 <<<"$out")
  # A kept build folder made from another source folder (a pip temp copy of an earlier run):
  # CMake refuses such a cache ("does not match the source"), and an ExternalProject's own
  # cache (Vulkan's shader generator) is not redone by the top-level reconfigure. Drop each
  # stale cache's folder: the top one means the whole build folder, a sub-project its prefix.
  local cache home dir
  while IFS= read -r cache; do
    home=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$cache")
    [[ -z $home || $home == "$root"* ]] && continue
    dir=$(dirname "$cache")
    [[ $dir == "$BUILD_DIR" ]] || dir=${dir%%-prefix/*}-prefix
    echo "stale CMake cache ($cache made from $home): removing $dir"
    rm -rf "$dir"
  done < <(find "$BUILD_DIR" -name CMakeCache.txt 2>/dev/null)
  python -m pip wheel -v --no-deps --no-build-isolation --no-index --disable-pip-version-check \
    -C build-dir="$BUILD_DIR" -w "$WORK/wheel" "$root" &&
  python -m pip install --no-deps --no-index --disable-pip-version-check "$WORK"/wheel/llama_cpp_python-*.whl
}
export -f build_llama
if [[ -n $LLAMA_WHEEL ]]; then
  stage install-llama-cpp 60 python -m pip install --no-deps --no-index --disable-pip-version-check "$LLAMA_WHEEL" \
    || fail "installing $LLAMA_WHEEL failed"
else
  stage build-llama-cpp "$BUILD_LIMIT_S" build_llama || fail "the $BACKEND build of llama-cpp-python failed (logs/build-llama-cpp.log)"
fi

stage install-engine 60 python -m pip install --no-deps --no-index --no-build-isolation --disable-pip-version-check -e "$REPO" \
  || fail "installing the engine failed (logs/install-engine.log)"

check_offload() {
  python - <<'EOF'
import llama_cpp
from hydra_trio.engine.llama.devices import read_ggml_devices
print("llama_supports_gpu_offload:", llama_cpp.llama_supports_gpu_offload())
for d in read_ggml_devices():
    print(f"device {d.index}: {d.type} {d.name} ({d.description}) {d.memory_total / 2**30:.1f} GiB")
raise SystemExit(0 if llama_cpp.llama_supports_gpu_offload() else 1)
EOF
}
export -f check_offload
stage offload 60 check_offload
cat "$OUTDIR/logs/offload.log"

cd "$REPO" || exit 1
stage gpu-tests "$TESTS_LIMIT_S" python -m pytest -q -m gpu tests/system/test_gpu.py -p no:cacheprovider -rA \
  --junitxml="$OUTDIR/gpu-tests.xml" -o junit_family=xunit2
TESTS_RC=$?
cp "$OUTDIR/logs/gpu-tests.log" "$OUTDIR/gpu-tests.log" 2>/dev/null
tail -n 15 "$OUTDIR/gpu-tests.log"

SERVER_ARGS=()
if (( WITH_SERVER )); then
  if [[ -x $BUILD_DIR/bin/llama-server ]]; then
    SERVER_ARGS=(--llama-server "$BUILD_DIR/bin/llama-server")
  else
    echo "llama-server was not built (see logs/build-llama-cpp.log): figures without it"
  fi
fi
FIG_LIMIT=$(( $(left) - 10 ))
export PYTHONUNBUFFERED=1
# FIGURES_ARGS: more figures.py flags (a CPU rehearsal passes "--preset tiny --quick").
read -r -a EXTRA_FIG_ARGS <<<"${FIGURES_ARGS:-}"
stage figures "$FIG_LIMIT" python benchmarks/gpu/figures.py "$OUTDIR" --budget-s $(( FIG_LIMIT - 60 )) \
  "${SERVER_ARGS[@]}" "${EXTRA_FIG_ARGS[@]}"
grep -E "tok/s|TTFT|DECODE ack|FAILED|skipped" "$OUTDIR/logs/figures.log" | tail -n 30

echo "=== stages (name, rc, seconds)"
cat "$OUTDIR/stages.tsv"
exit $(( TESTS_RC != 0 ))
