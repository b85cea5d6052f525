#!/usr/bin/env bash
# On a GPU machine: the engine benchmarks of docs/benchmarks.md (Llama-3-8B shape, dummy bf16
# weights). W2: batch-1 decode latency, 128 in / 256 out. W1: 1000 prompts x 256 in / 256 out.
# Results go to stdout and, with $OUT, to $OUT/benchmarks.jsonl.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
model=/tmp/zllm-llama3-8b
python benchmarks/dummy_model.py llama3-8b "$model" >/dev/null
python - <<'PY' | tee -a "$out/benchmarks.jsonl"
import json, subprocess, time, torch
def copy_bandwidth():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
    for _ in range(3): y.copy_(x)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 20 * x.numel() / (time.perf_counter() - t) / 1e12
print(json.dumps({"gpu": torch.cuda.get_device_name(0), "copy_TBps": round(copy_bandwidth(), 2)}))
PY
echo "== W2"; python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 2>&1 | grep -E '^\{|Error|error' | tee -a "$out/benchmarks.jsonl"
echo "== W1"; python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
  --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 2>&1 | grep -E '^\{|Error|error' | tee -a "$out/benchmarks.jsonl"
