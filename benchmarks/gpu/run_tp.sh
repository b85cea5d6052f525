#!/usr/bin/env bash
# On a machine with >= 2 GPUs (nvidia-h200-x2): tensor-parallel GPU tests and the figures of
# docs/benchmarks.md. Usage: bash benchmarks/gpu/run_tp.sh [8b|70b|symm|all]. JSON lines go to $OUT/tp.jsonl.
# Carry .whl/ as for run_all.sh (its header: pyzmq, msgspec, xgrammar and its needs; env.sh installs them).
# `symm` (not part of `all`) checks the symmetric-memory all-reduce (--custom-all-reduce-max-size):
# every command under a time limit, a PASS/FAIL/TIMEOUT line each, logs in $OUT/symm-*.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/env.sh
out="${OUT:-/tmp}"
mkdir -p "$out"
what="${1:-all}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
json() { grep -E '^\{' | tee -a "$out/tp.jsonl"; }
if [[ "$what" == 8b || "$what" == all ]]; then
  python benchmarks/dummy_model.py llama3-8b /tmp/zllm-llama3-8b >/dev/null
  echo "== GPU tests (tp)"; python -m pytest -q -p no:cacheprovider tests/gpu -k "(tensor_parallel or tp) and not symmetric" 2>&1 | tail -5
  echo "== agreement tp2 vs tp1, 8B bf16"
  python benchmarks/tp_agreement.py --model /tmp/zllm-llama3-8b --load-format dummy --dtype bfloat16 --tp 2 \
    --num-prompts 32 --input-len 64 --output-len 128 2>"$out/agreement.log" | json
  for tp in 1 2; do
    echo "== W2 8B tp $tp"
    python benchmarks/latency.py --model /tmp/zllm-llama3-8b --load-format dummy --input-len 128 --output-len 256 \
      --iters 3 --tp "$tp" 2>"$out/latency8b-tp$tp.log" | json
  done
fi
if [[ "$what" == 70b || "$what" == all ]]; then
  python benchmarks/dummy_model.py llama3-70b /tmp/zllm-llama3-70b >/dev/null
  echo "== 70B tp 2 batch-1 decode"
  python benchmarks/latency.py --model /tmp/zllm-llama3-70b --load-format dummy --input-len 128 --output-len 256 \
    --iters 2 --tp 2 --max-model-len 1024 2>"$out/latency70b.log" | json
  echo "== 70B tp 2 throughput 500 x 256/256"
  python benchmarks/throughput.py --model /tmp/zllm-llama3-70b --load-format dummy --num-prompts 500 --input-len 256 \
    --output-len 256 --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 --tp 2 \
    2>"$out/throughput70b.log" | json
fi
if [[ "$what" == symm* ]]; then
  # The symmetric-memory all-reduce, in parts that each fit one 10-minute device call:
  # symm-unit, symm-engine, symm-8b, symm-70b ("symm": all four, for a longer call). Every command
  # runs under `timeout` (its whole process group) within $SYMM_BUDGET_S seconds for the call.
  export ZLLM_DEBUG_HANG_S="${ZLLM_DEBUG_HANG_S:-120}"  # a hang prints every worker thread's stack
  deadline=$(( $(date +%s) + ${SYMM_BUDGET_S:-570} ))
  symm_status=0
  bounded() {  # bounded NAME SECONDS COMMAND...: log to $OUT/symm-NAME.log, then PASS/FAIL/TIMEOUT
    local name=$1 limit=$2
    shift 2
    local left=$(( deadline - $(date +%s) - 25 ))
    (( left < limit )) && limit=$left
    if (( limit < 30 )); then echo "SKIPPED $name (no time left in this call)"; symm_status=1; return; fi
    echo "== symm $name (limit ${limit}s): $*"
    timeout -k 15 "$limit" "$@" >"$out/symm-$name.log" 2>&1
    local rc=$?
    grep -E '^\{' "$out/symm-$name.log" | tee -a "$out/tp.jsonl"
    tail -4 "$out/symm-$name.log"
    if [[ $rc -eq 0 ]]; then echo "PASS $name"
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then echo "TIMEOUT $name (stacks in $out/symm-$name.log)"; symm_status=1
    else echo "FAIL $name (exit $rc)"; symm_status=1; fi
    echo "   fast path set up on $(grep -c 'symmetric-memory one-shot all-reduce for' "$out/symm-$name.log") rank(s);" \
      "NCCL fallbacks: $(grep -c 'NCCL for all reduces' "$out/symm-$name.log")"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader  # should print nothing
  }
  env | grep -E '^(TORCH_SYMM|NCCL_NVLS|NVSHMEM)' || echo "(no TORCH_SYMM/NCCL_NVLS/NVSHMEM variables set)"
  python -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count(),
    "p2p 0->1", torch.cuda.can_device_access_peer(0, 1))'
  pytest_args=(-q -p no:cacheprovider -rs tests/gpu/test_tensor_parallel_gpu.py)
  python -c 'import pytest_timeout' 2>/dev/null && pytest_args+=(--timeout 300 --timeout-method thread)
  if [[ "$what" == symm || "$what" == symm-unit ]]; then
    bounded unit 300 python -m pytest "${pytest_args[@]}" -k symmetric_all_reduce_equals_nccl
  fi
  if [[ "$what" == symm || "$what" == symm-engine ]]; then
    bounded engine 540 python -m pytest "${pytest_args[@]}" -k symmetric_all_reduce_gives_nccls_tokens
  fi
  for model in 8b 70b; do
    [[ "$what" == symm || "$what" == "symm-$model" ]] || continue
    python benchmarks/dummy_model.py "llama3-$model" "/tmp/zllm-llama3-$model" >/dev/null
    extra=(--iters 3)
    [[ $model == 70b ]] && extra=(--iters 2 --max-model-len 1024)
    for size in 8MiB 0; do  # on first: the new path is what may hang
      bounded "latency$model-$size" 270 python benchmarks/latency.py --model "/tmp/zllm-llama3-$model" \
        --load-format dummy --input-len 128 --output-len 256 --tp 2 --custom-all-reduce-max-size "$size" "${extra[@]}"
    done
  done
  echo "== $what: $([[ $symm_status -eq 0 ]] && echo 'all passed' || echo 'SOMETHING FAILED (see above)')"
  exit $symm_status
fi
