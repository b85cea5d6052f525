#!/usr/bin/env bash
# Issue 38's eight-GPU must-show, for the day a machine of 8 GPUs is lent: one PART per device
# call, each under 9 minutes. Usage: bash benchmarks/gpu/run_8gpu.sh PART, PART one of
#
#   agree:      greedy agreement of tp 8 with tp 4 in fp32 (benchmarks/tp_agreement.py --require-equal,
#               32 prompts of 64 in / 64 out) on a smaller shape of each family: deepseek-v3-small
#               (V3's layers, block FP8 kept in FP8: weight-only, so fp32 tp 8 = tp 4) and llama3-8b
#               (dummy bf16 weights served in fp32; online FP8 is left out: its per-token activation
#               scales are taken per rank's slice in the row-parallel layers, so tp 8 and tp 4 differ).
#   v3-serve:   vllm-launch --tp 8 on the DeepSeek-V3 shape (671B, dummy block-FP8 weights kept in
#               FP8: 79.5 GiB a rank, so H200s only), batch 1 (6 one-prompt runs, 128 in / 256 out),
#               then the served tails under Poisson 2 req/s (200 prompts, 256/256) through vLLM's
#               client, then SIGTERM: exit 0 and no process left on a GPU.
#   v3-w2:      W2 (benchmarks/latency.py, batch 1, 128 in / 256 out) at tp 8 on the V3 shape.
#   v3-w1:      W1 (benchmarks/throughput.py, 256 x 256/256 offline) at tp 8 on the V3 shape.
#   405b-serve, 405b-w2, 405b-w1: the same on the Llama-3.1-405B shape with FP8 weights (per channel,
#               tokens quantized on the fly; 47.8 GiB a rank: fits 8 H100s too), W1 over 500 prompts.
#
# Kind: nvidia-h200-x8 (needs_h200 for the V3 parts: its FP8 weights alone are 79.5 GiB a rank at
# tp 8, docs/benchmarks.md); the 405B and agree parts fit nvidia-h100-x8. Carry .whl (pyzmq, msgspec,
# xgrammar and its needs, aiohttp and its dependencies: run_all.sh's header) and, for the serve
# parts, .sdist (vLLM's client: python benchmarks/vllm_benchmark_serving.py --download-only).
# Estimates (untested: no 8-GPU machine so far): each start of the V3 shape ~3-5 min (hashing and
# quantizing 84 GB of dummy weights a rank, the memory profile, graph capture), of the 405B ~2-3
# min; so each part is one start and what follows it. Every command runs under `timeout`, all within
# $BUDGET_S (default 530 s); each step prints PASS/FAIL/TIMEOUT/SKIPPED. Into $OUT (default
# /tmp/zllm-8gpu): 8gpu-PART.log, 8gpu-PART.jsonl, PART.md (serve parts), 8gpu-PART-logs.tar.gz.
# Exits 1 if anything failed or was skipped.
set -uo pipefail
t0=$(date +%s)
cd "$(dirname "$0")/../.."
part="${1:-}"
case "$part" in agree | v3-serve | v3-w2 | v3-w1 | 405b-serve | 405b-w2 | 405b-w1) ;;
*) echo "usage: $0 agree|v3-serve|v3-w2|v3-w1|405b-serve|405b-w2|405b-w1"; exit 2 ;;
esac
dest="${OUT:-/tmp/zllm-8gpu}"
out=/tmp/zllm-8gpu-$part
rm -rf "$out"
mkdir -p "$dest" "$out"
exec > >(tee -a "$dest/8gpu-$part.log") 2>&1
jsonl="$dest/8gpu-$part.jsonl"
deadline=$(( t0 + ${BUDGET_S:-530} ))
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1
export ZLLM_CSRC_BUILD=/tmp/zllm-csrc-build  # fresh here; reused by later parts on the same warm machine
if [[ -z "${SKIP_CSRC_BUILD:-}" && ! -f $ZLLM_CSRC_BUILD/sm_90/attention_kernels.cubin ]]; then
  bounded csrc-build 240 bash scripts/build_csrc.sh "$ZLLM_CSRC_BUILD" -DZLLM_CUBIN_ARCHS=90 \
    || echo "   (the kernel loader falls back to what was built, or NVRTC)"
fi
dummy() {  # dummy SHAPE DIR: the dummy model directory (benchmarks/dummy_model.py)
  [[ -d "$2" ]] || python benchmarks/dummy_model.py "$1" "$2" > /dev/null
}
family=${part%%-*}
case "$family" in
v3) model=/tmp/zllm-deepseek-v3 shape=deepseek-v3 w1_prompts=256 ;;
405b) model=/tmp/zllm-llama3.1-405b shape=llama3.1-405b w1_prompts=500 ;;
esac
common=(--load-format dummy --max-model-len 1024 --tp 8)

case "$part" in
agree)
  dummy deepseek-v3-small /tmp/zllm-v3-small
  dummy llama3-8b /tmp/zllm-llama3-8b
  for m in /tmp/zllm-v3-small /tmp/zllm-llama3-8b; do
    bounded "agree-$(basename "$m")-tp8-vs-tp4-fp32" 240 python benchmarks/tp_agreement.py --model "$m" \
      --load-format dummy --dtype float32 --tp 8 --reference-tp 4 --num-prompts 32 --input-len 64 --output-len 64 \
      --max-model-len 512 --require-equal
    gpus_free 30 || { echo "FAIL: GPU memory still held after the agreement run"; status=1; }
  done
  ;;
*-serve)
  need_client_files || exit 1
  dummy "$shape" "$model"
  results="$out/$part"
  mkdir -p "$results"
  client=(--model "$(basename "$model")" --tokenizer "$model" --ignore-eos)
  # Prefix caching off: each one-prompt run of the client sends its prompt twice (its initial test
  # run is request 0), and the second would be a cache hit (run_4gpu.sh's serve70b).
  if serve_start "$part" 360 --model "$model" "${common[@]}" --no-enable-prefix-caching; then
    vllm_client "$part-warm" 120 "${client[@]}" --num-prompts 16 --request-rate inf --random-input-len 256 \
      --random-output-len 64 --seed 1000
    for i in 1 2 3 4 5 6; do
      fits "$part-batch1-$i" 20 160 || break
      vllm_client "$part-batch1-$i" 90 "${client[@]}" --num-prompts 1 --request-rate inf --random-input-len 128 \
        --random-output-len 256 --seed $(( 100 + i )) --save-result --result-dir "$results" \
        --result-filename "batch1_$i.json" --metadata label=batch-1
    done
    if fits "$part-poisson2" 120 30; then
      vllm_client "$part-poisson2" 260 "${client[@]}" --num-prompts 200 --request-rate 2 --random-input-len 256 \
        --random-output-len 256 --seed 2 --save-result --result-dir "$results" --result-filename poisson2.json \
        --metadata label=poisson
    fi
    serve_stop 90
    verdict "server $part: vllm-launch exited 0 after SIGTERM" $?
    gpus_free 30
    verdict "server $part: no process left on a GPU" $?
  fi
  timeout 60 python benchmarks/plot_sweep.py "$results" | tee "$dest/$part.md"
  ;;
*-w2)
  dummy "$shape" "$model"
  bounded "$part" 500 python benchmarks/latency.py --model "$model" "${common[@]}" --input-len 128 --output-len 256 --iters 2
  ;;
*-w1)
  dummy "$shape" "$model"
  bounded "$part" 500 python benchmarks/throughput.py --model "$model" "${common[@]}" --num-prompts "$w1_prompts" \
    --input-len 256 --output-len 256 --no-detokenize --quiet --max-num-batched-tokens 8192
  ;;
esac
pack_results "$dest" "8gpu-$part"
echo "== $part: $( ((status == 0)) && echo 'all passed' || echo 'SOMETHING FAILED OR WAS SKIPPED (see above)'), $(( $(date +%s) - t0 )) s"
exit $status
