#!/usr/bin/env bash
# Issue 31 on one H100: the window / soft-cap GPU tests, then W2 (batch-1 decode, 128 in / 256 out)
# and W1 (1000 x 256 in / 256 out offline, ignore_eos) for the Gemma-3-12B and Phi-4 (14B) shapes
# with dummy bf16 weights. One PART per device call:
#   bash benchmarks/gpu/run_models.sh tests|w2|w1|window
# window: benchmarks/window_memory.py on the Gemma-3-12B shape at 32k tokens, window-aware blocks
# and every block kept (--disable-hybrid-kv-cache-manager): KV per sequence, max concurrency, and
# that many 32k sequences run at once.
# Carry .whl; csrc is built into $ZLLM_CSRC_BUILD (default /tmp/zllm-csrc) unless a build is
# there already (or carry a prebuilt sm_90 folder and point ZLLM_CSRC_BUILD at a copy of it).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/env.sh
export ZLLM_CSRC_BUILD=${ZLLM_CSRC_BUILD:-/tmp/zllm-csrc}
[ -f "$ZLLM_CSRC_BUILD/sm_90/attention_window_kernels.cubin" ] || bash scripts/build_csrc.sh "$ZLLM_CSRC_BUILD" -DZLLM_CUBIN_ARCHS=90 > /tmp/csrc-build.log 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for shape in gemma3-12b phi4; do
  [ -d /tmp/$shape ] || python3 benchmarks/dummy_model.py $shape /tmp/$shape > /dev/null
done
case ${1:-} in
  tests)
    timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_windowed_kernels_gpu.py tests/gpu/test_windowed_models_gpu.py --tb=short 2>&1 | tail -15 ;;
  w2)
    for shape in gemma3-12b phi4; do
      echo "== W2 $shape"
      timeout 240 python3 benchmarks/latency.py --model /tmp/$shape --load-format dummy --input-len 128 --output-len 256 --iters 3 2>&1 | grep -E '^\{|Error|error' | tail -3
    done ;;
  w1)
    for shape in gemma3-12b phi4; do
      echo "== W1 $shape"
      timeout 280 python3 benchmarks/throughput.py --model /tmp/$shape --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --no-detokenize --max-model-len 1024 --max-num-batched-tokens 8192 2>&1 | grep -E '^\{|Error|error|req/s' | tail -3
    done ;;
  window)
    for flag in "" --disable-hybrid-kv-cache-manager; do
      echo "== window_memory gemma3-12b 32k $flag"
      timeout 280 python3 benchmarks/window_memory.py --model /tmp/gemma3-12b --max-model-len 32768 $flag 2>&1 | grep -E '^\{|Error|error' | tail -3
    done ;;
  *) echo "usage: $0 tests|w2|w1|window" >&2; exit 2 ;;
esac
