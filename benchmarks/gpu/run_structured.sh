#!/usr/bin/env bash
# On nvidia-h100-x1: structured outputs (issue 19). Carry .whl (pyzmq, msgspec, xgrammar and its
# needs: ../shared/gpu/wheels.sh xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection),
# and for PART=bench .tok (the embedded SmolLM2's tokenizer files; the tests train their own).
# Usage: bash benchmarks/gpu/run_structured.sh PART
#   PART=correct: csrc build, the structured-output GPU tests, the engine GPU tests (async vs sync, vs HF)
#   PART=bench:   benchmarks/structured_outputs.py on the Llama-3-8B shape (dummy bf16, SmolLM2's tokenizer)
# Logs and JSON lines go to $OUT (default /tmp/zllm-structured).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/env.sh  # the repository on PYTHONPATH, the carried wheels installed
out="${OUT:-/tmp/zllm-structured}"
mkdir -p "$out"
export ZLLM_CSRC_BUILD=/tmp/zllm-csrc-build
[ -f $ZLLM_CSRC_BUILD/sm_90/attention_kernels.cubin ] || bash scripts/build_csrc.sh "$ZLLM_CSRC_BUILD" > "$out/build.log" 2>&1
case "${1:-}" in
correct)
  timeout 500 python -m pytest -q -p no:cacheprovider -rs -p no:warnings --tb=short tests/gpu/test_structured_outputs_gpu.py \
    tests/gpu/test_async_scheduling_gpu.py tests/gpu/test_engine_gpu.py > "$out/pytest.log" 2>&1; tail -40 "$out/pytest.log"
  ;;
bench)
  model=/tmp/zllm-llama3-8b-bpe
  python benchmarks/dummy_model.py llama3-8b "$model" --tokenizer .tok >/dev/null
  timeout 500 python benchmarks/structured_outputs.py --model "$model" --load-format dummy --num-prompts 64 \
    --input-len 128 --output-len 256 2>&1 | tee "$out/bench.log" | grep -E '^\{'
  ;;
*) echo "usage: $0 correct|bench"; exit 2 ;;
esac
