#!/usr/bin/env bash
# Issue 32 on one H100: the MLA / sinks GPU tests (kernels; tiny models against HF and, with decode
# CUDA graphs, against the eager run), then W2 (batch-1 decode, 128 in / 256 out) and
# W1 (1000 x 256 in / 256 out offline, ignore_eos) for the DeepSeek-V2-Lite shape (16B, 2.4B
# active; MLA) and the gpt-oss-20b shape (MXFP4 experts, dequantized to bf16 at load) with dummy
# weights, and the KV memory of MLA at 8k (its latent cache against per-head K/V, computed). One
# PART per device call:
#   bash benchmarks/gpu/run_issue32.sh tests|w2|w2eager|w1|kv   (w2eager: W2 with --enforce-eager)
# Carry .whl; csrc is built into $ZLLM_CSRC_BUILD (default /tmp/zllm-csrc) unless a build is there.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/env.sh
export ZLLM_CSRC_BUILD=${ZLLM_CSRC_BUILD:-/tmp/zllm-csrc}
[ -f "$ZLLM_CSRC_BUILD/sm_90/mla_kernels.cubin" ] || bash scripts/build_csrc.sh "$ZLLM_CSRC_BUILD" -DZLLM_CUBIN_ARCHS=90 > /tmp/csrc-build.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for shape in deepseek-v2-lite gpt-oss-20b; do
  [ -d /tmp/$shape ] || python3 benchmarks/dummy_model.py $shape /tmp/$shape > /dev/null
done
case ${1:-} in
  tests)
    timeout 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mla_sinks_gpu.py --tb=short --durations=10 2>&1 | tail -30 ;;
  w2|w2eager)
    # w2: decode CUDA graphs on (the default); w2eager: --enforce-eager, the graphs' baseline
    # (run both on the same warm machine to compare).
    flag=$([ "$1" = w2eager ] && echo --enforce-eager)
    for shape in deepseek-v2-lite gpt-oss-20b; do
      echo "== W2 $shape ${flag:-graphs}"
      timeout 280 python3 benchmarks/latency.py --model /tmp/$shape --load-format dummy --input-len 128 --output-len 256 --iters 3 $flag 2>&1 | grep -E '^\{|Error|error' | tail -3
    done ;;
  w1)
    for shape in deepseek-v2-lite gpt-oss-20b; do
      echo "== W1 $shape"
      timeout 280 python3 benchmarks/throughput.py --model /tmp/$shape --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --no-detokenize --max-model-len 1024 --max-num-batched-tokens 8192 2>&1 | grep -E '^\{|Error|error|req/s' | tail -3
    done ;;
  kv)
    echo "== KV memory deepseek-v2-lite 8k"
    timeout 280 python3 benchmarks/window_memory.py --model /tmp/deepseek-v2-lite --max-model-len 8192 2>&1 | grep -E '^\{|Error|error' | tail -3 ;;
  *) echo "usage: $0 tests|w2|w2eager|w1|kv" >&2; exit 2 ;;
esac
