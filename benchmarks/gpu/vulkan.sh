#!/usr/bin/env bash
# The GPU check's own steps (run.sh) on a Vulkan device; on a machine without a GPU, Mesa's
# lavapipe (llvmpipe: Vulkan computed on the CPU). The rehearsal of the H200 run, and the
# Vulkan lane (AMD and Intel GPUs use this backend).
#
#   bash benchmarks/gpu/vulkan.sh OUTDIR [--with-llama-server]
#
# From a checkout with the project installed (.venv, as the README says; PREP_PYTHON= another
# Python that has llama-cpp-python):
#   1. the Vulkan build tools: glslc, the Vulkan headers and loader, SPIRV-Headers, a Vulkan
#      driver, vulkaninfo (Debian/Ubuntu packages; installed with apt-get when missing and
#      this runs as root, otherwise named and the lane stops);
#   2. benchmarks/gpu/prepared/ (prepare.py --check) unless it is there with Vulkan sources;
#   3. bash benchmarks/gpu/run.sh OUTDIR --backend vulkan: the H200 run's steps and result
#      files (run.log, stages.tsv, gpu-tests.xml, figures.json, all.tar.gz), with the time
#      limits of a 2-core machine compiling several hundred shaders (VULKAN_BUDGET_S, default
#      7200 s in all) and the figures on the tiny preset (VULKAN_FIGURES_ARGS).
# The CMake build folder is kept (LLAMA_BUILD_DIR, default ~/.cache/hydra-trio/vulkan-build):
# a rerun recompiles nothing that did not change. Not part of .ci/run (it takes long here).
set -uo pipefail

usage() { echo "usage: bash benchmarks/gpu/vulkan.sh OUTDIR [--with-llama-server]" >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
OUTDIR=$1; shift
for arg in "$@"; do [[ $arg == --with-llama-server ]] || usage; done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PREP=$REPO/benchmarks/gpu/prepared
PREP_PY=${PREP_PYTHON:-$REPO/.venv/bin/python}

# 1. tools: each check, with the Debian/Ubuntu package that provides it.
missing=()
command -v glslc >/dev/null || missing+=(glslc)
[[ -f /usr/include/vulkan/vulkan.h ]] || missing+=(libvulkan-dev)
compgen -G "/usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake" >/dev/null \
  || compgen -G "/usr/lib/*/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake" >/dev/null || missing+=(spirv-headers)
compgen -G "/usr/share/vulkan/icd.d/*.json" >/dev/null || missing+=(mesa-vulkan-drivers)
command -v vulkaninfo >/dev/null || missing+=(vulkan-tools)
if (( ${#missing[@]} )); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]} (apt-get)"
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
      || { echo "vulkan.sh: apt-get install ${missing[*]} failed" >&2; exit 1; }
  else
    echo "vulkan.sh: missing ${missing[*]}: apt-get install ${missing[*]} (or your system's equivalents)" >&2
    exit 1
  fi
fi
vulkaninfo --summary >/dev/null 2>&1 || { echo "vulkan.sh: vulkaninfo finds no Vulkan device" >&2; exit 1; }

# 2. prepared/ with the Vulkan sources in its sdist (an older prepare.py trimmed them).
have_vulkan_sdist() {
  local sdist
  sdist=$(ls "$PREP"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n 1)
  # grep -c reads to the end: grep -q would stop tar with SIGPIPE, a failure under pipefail
  [[ -n $sdist && -d $PREP/wheels ]] && (( $(tar tzf "$sdist" | grep -c '/ggml/src/ggml-vulkan/CMakeLists.txt$') > 0 ))
}
"$PREP_PY" -c 'import llama_cpp' 2>/dev/null \
  || { echo "vulkan.sh: $PREP_PY has no llama-cpp-python: install the project first (README), or set PREP_PYTHON" >&2; exit 1; }
# The wheels always: a dependency added since prepared/ was written (orjson) would be missing
# from the lane's --no-index venv (pip's cache makes a rerun quick); the sdist when it lacks Vulkan.
skip_sdist=()
have_vulkan_sdist && skip_sdist=(--skip-sdist)
"$PREP_PY" "$REPO/benchmarks/gpu/prepare.py" --check "${skip_sdist[@]}" || { echo "vulkan.sh: prepare.py failed" >&2; exit 1; }

# 3. run.sh's steps, with this machine's limits.
export GPU_CHECK_BUDGET_S=${VULKAN_BUDGET_S:-7200}
export BUILD_LIMIT_S=${BUILD_LIMIT_S:-5400}
export TESTS_LIMIT_S=${TESTS_LIMIT_S:-900}
export LLAMA_BUILD_DIR=${LLAMA_BUILD_DIR:-$HOME/.cache/hydra-trio/vulkan-build}
export FIGURES_ARGS=${VULKAN_FIGURES_ARGS:---preset tiny --quick --no-gemma}
exec bash "$REPO/benchmarks/gpu/run.sh" "$OUTDIR" --backend vulkan "$@"
