#!/usr/bin/env bash
# Build the CUDA kernels (csrc/) into cubins and PTX; needs nvcc and cmake, not a GPU.
# Usage: scripts/build_csrc.sh [BUILD_DIR]   (default: $ZLLM_CSRC_BUILD, else csrc/build)
# Extra cmake -D options may follow the build dir, e.g. -DZLLM_RESOURCE_USAGE=ON.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${1:-${ZLLM_CSRC_BUILD:-csrc/build}}"
shift || true
jobs="${ZLLM_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
cmake -S csrc -B "$build_dir" "$@"
cmake --build "$build_dir" -j"$jobs"
