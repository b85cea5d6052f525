#!/usr/bin/env bash
# On a GPU machine, from anywhere:  bash benchmarks/gpu/run_all.sh
# Carry .whl/, the wheels the GPU image lacks (pyzmq, msgspec, and xgrammar with its needs), made
# here by:  ../shared/gpu/wheels.sh xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
# (env.sh installs them; without xgrammar, a hard dependency, the GPU tests fail at collection).
# Nothing else: the structured-output tests train their own sub-word tokenizer.
# Builds csrc (scripts/build_csrc.sh), runs the GPU tests and the csrc build test, a subset of the
# GPU tests again through NVRTC, then the kernel benchmarks (table last). Every log also goes to
# $OUT when it is set. Exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/env.sh
out="${OUT:-}"
[ -n "$out" ] && mkdir -p "$out"

log() {  # log NAME: copy stdin to stdout and, with $OUT, to $OUT/NAME
  if [ -n "$out" ]; then tee "$out/$1"; else cat; fi
}

status=0
step() {  # step NAME LOG COMMAND...
  local name=$1 logfile=$2
  shift 2
  echo "==== $name: $*"
  "$@" 2>&1 | log "$logfile"
  local rc=${PIPESTATUS[0]}
  echo "==== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
  results+=("$(printf '%-10s %s' "$name" "$([ "$rc" -eq 0 ] && echo ok || echo "FAILED ($rc)")")")
}
results=()

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | log gpu.txt
step build build.log bash scripts/build_csrc.sh
step tests pytest.log python -m pytest -q -p no:cacheprovider -rs tests/gpu tests/test_csrc_build.py
# The run-time compile path (NVRTC) on a subset, as on a GPU with no matching cubin.
step nvrtc pytest-nvrtc.log env ZLLM_KERNELS=nvrtc python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_kernels.py \
  -k "graph or block_boundaries or forced_partitions or strided or reshape_and_cache or rotary_embedding_query"
step bench bench.log python benchmarks/gpu/bench_kernels.py

echo
echo "==== summary"
printf '%s\n' "${results[@]}" | log summary.txt
exit $status
