#!/usr/bin/env bash
# On a machine with >= 2 GPUs (nvidia-h200-x2): tensor-parallel GPU tests and the figures of
# docs/benchmarks.md. Usage: bash tests/gpu/run_tp.sh [8b|70b|all]. JSON lines go to $OUT/tp.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
what="${1:-all}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
json() { grep -E '^\{' | tee -a "$out/tp.jsonl"; }
if [[ "$what" == 8b || "$what" == all ]]; then
  python benchmarks/dummy_model.py llama3-8b /tmp/zllm-llama3-8b >/dev/null
  echo "== GPU tests (tp)"; python -m pytest -q -p no:cacheprovider tests/gpu -k "tensor_parallel or tp" 2>&1 | tail -5
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
