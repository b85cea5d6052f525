#!/usr/bin/env bash
# The platform features' GPU work on one H100, one PART per device call (each fits the 600 s
# limit; a machine stays warm 30 s after a call, and /tmp survives while it does):
#   tests   the GPU tests of DeepSeek MLA / GPT-OSS sinks (issue 32), LoRA (issue 34), vision (issue 35)
#   lora    benchmarks/lora_serving.py: kernels, W1 over 0 / 8 / 64 adapters, W2 with 0 / 1 adapter
#   lora-ab the LoRA paths alone (ZLLM_LORA_DENSE_ROWS_PER_SLOT=inf: kernels; 0: dense) on W1 and W2
#   lora-fused  W2 with no adapter, then one adapter with the expand unfused and fused (ZLLM_LORA_FUSED_EXPAND)
#   lora-norm   W2 with no adapter, then one adapter with the q/k/v and gate/up shrinks in the norm off and
#               on (ZLLM_LORA_NORM_SHRINK), then tests/gpu/test_lora_norm_gpu.py
#   vision  benchmarks/vision.py on the Qwen2.5-VL-7B shape (dummy weights)
#   i32     benchmarks/gpu/run_issue32.sh w2 and kv
# Carry .whl (pyzmq, msgspec, xgrammar, peft, accelerate and their needs) and .csrc90/sm_90 (the
# prebuilt cubins: ZLLM_BUILD_JOBS=2 bash scripts/build_csrc.sh .csrc90 -DZLLM_CUBIN_ARCHS=90).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/env.sh
if [ -d .csrc90/sm_90 ]; then
  mkdir -p /tmp/cb && cp -r .csrc90/sm_90 /tmp/cb/ && touch /tmp/cb/sm_90/*
  export ZLLM_CSRC_BUILD=/tmp/cb ZLLM_KERNELS=prebuilt
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
out=${OUT:-/tmp/out}; mkdir -p "$out"
case ${1:-} in
  tests)
    for f in test_lora_gpu test_vision_gpu test_mla_sinks_gpu; do
      echo "== $f"
      timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu/$f.py --tb=short > "$out/$f.log" 2>&1
      tail -4 "$out/$f.log"; grep -E "^(FAILED|ERROR)" "$out/$f.log" | head -8
    done ;;
  lora)
    [ -d /tmp/llama3-8b ] || python3 benchmarks/dummy_model.py llama3-8b /tmp/llama3-8b > /dev/null
    # Every line goes to $out/lora.log too (the kernels table has 60 rows; the tail shows 4).
    run() { echo "== lora $*"; timeout 200 python3 benchmarks/lora_serving.py "$@" --model /tmp/llama3-8b 2>&1 | tee -a "$out/lora.log" | grep -E '^\{|Error|error' | tail -4; }
    run kernels
    run w2 --adapters 0 --iters 3
    run w2 --adapters 1 --iters 3
    run w1 --adapters 0 --iters 1
    run w1 --adapters 8 --max-loras 8 --iters 1
    run w1 --adapters 64 --max-loras 16 --iters 1 ;;
  lora-ab)
    # The LoRA paths' A/B on W1 (8 adapters) and W2: the kernels only, then the dense path only.
    [ -d /tmp/llama3-8b ] || python3 benchmarks/dummy_model.py llama3-8b /tmp/llama3-8b > /dev/null
    run() { echo "== lora $*"; timeout 200 python3 benchmarks/lora_serving.py "$@" --model /tmp/llama3-8b 2>&1 | tee -a "$out/lora.log" | grep -E '^\{|Error|error' | tail -4; }
    ZLLM_LORA_DENSE_ROWS_PER_SLOT=inf run w1 --adapters 8 --max-loras 8 --iters 1
    ZLLM_LORA_DENSE_ROWS_PER_SLOT=0 run w1 --adapters 8 --max-loras 8 --iters 1
    ZLLM_LORA_DENSE_ROWS_PER_SLOT=0 run w2 --adapters 1 --iters 3 ;;
  lora-fused)
    # W2's A/B of the expand in the GEMV's epilogue: base, unfused, fused (one machine, one call).
    [ -d /tmp/llama3-8b ] || python3 benchmarks/dummy_model.py llama3-8b /tmp/llama3-8b > /dev/null
    run() { echo "== lora $*"; timeout 180 python3 benchmarks/lora_serving.py "$@" --model /tmp/llama3-8b 2>&1 | tee -a "$out/lora.log" | grep -E '^\{|Error|error' | tail -4; }
    run w2 --adapters 0 --iters 3
    ZLLM_LORA_FUSED_EXPAND=0 run w2 --adapters 1 --iters 3
    ZLLM_LORA_FUSED_EXPAND=1 run w2 --adapters 1 --iters 3 ;;
  lora-norm)
    # W2's A/B of the shrink in the add-RMSNorm (base, off, on), then its GPU tests (one call).
    [ -d /tmp/llama3-8b ] || python3 benchmarks/dummy_model.py llama3-8b /tmp/llama3-8b > /dev/null
    run() { echo "== lora $*"; timeout 130 python3 benchmarks/lora_serving.py "$@" --model /tmp/llama3-8b 2>&1 | tee -a "$out/lora.log" | grep -E '^\{|Error|error' | tail -4; }
    run w2 --adapters 0 --iters 3
    ZLLM_LORA_NORM_SHRINK=0 run w2 --adapters 1 --iters 3
    ZLLM_LORA_NORM_SHRINK=1 run w2 --adapters 1 --iters 3
    echo "== test_lora_norm_gpu"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lora_norm_gpu.py --tb=short > "$out/test_lora_norm_gpu.log" 2>&1
    tail -4 "$out/test_lora_norm_gpu.log"; grep -E "^(FAILED|ERROR)" "$out/test_lora_norm_gpu.log" | head -8 ;;
  vision)
    [ -d /tmp/qwen2.5-vl-7b ] || python3 benchmarks/dummy_model.py qwen2.5-vl-7b /tmp/qwen2.5-vl-7b > /dev/null
    timeout 520 python3 benchmarks/vision.py --model /tmp/qwen2.5-vl-7b --load-format dummy --requests 500 --output-len 128 2>&1 | grep -E '^\{|Error|error|image processor' | tail -8 ;;
  i32)
    bash benchmarks/gpu/run_issue32.sh w2
    bash benchmarks/gpu/run_issue32.sh kv ;;
  *) echo "usage: $0 tests|lora|lora-ab|lora-fused|lora-norm|vision|i32" >&2; exit 2 ;;
esac
