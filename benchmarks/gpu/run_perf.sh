#!/usr/bin/env bash
# On nvidia-h100-x1: issue 10's figures (Llama-3-8B shape, dummy bf16), each with async scheduling
# on (the default) and, where named, off for the before/after. Usage: bash benchmarks/gpu/run_perf.sh PART
#   PART=correct: csrc build + the engine GPU tests (async vs sync, no host syncs, vs HF)
#   PART=latency: copy bandwidth, W2 (batch-1 decode), step profile at batch 256 and 1
#   PART=load:    W1 (1000 x 256/256 offline), W3 (serve.py, Poisson 20 req/s, 400 x 256/256)
#   PART=mix:     issue 20's baseline: W1, W1's time by kind of step (step_mix.py), W2, and
#                 serve.py at Poisson 32 req/s, 600 x 256/256 (RATE=... overrides the rate)
#   PART=fp8:     issue 17: FP8 GPU tests, benchmarks/fp8_linear.py, then W2 and W1 in bf16 and with
#                 --quantization fp8, back to back in this one call
#   PART=kvfp8:   issue 17's FP8 KV cache: W1 with the bf16 cache, the FP8 cache, and FP8 weights
#                 plus the FP8 cache (the KV block counts are in each W1 line); W2 with the FP8 cache
#   PART=quant:   the one-pass FP8 activation quantization's A/B (ZLLM_QUANT_VEC=0 then 1): FP8 GPU
#                 tests, benchmarks/fp8_linear.py, W1 with --quantization fp8 both ways
#   PART=fp8profile: W1 and W2 with FP8 weights and the FP8 cache, and the step profile at batch 1
#                 and 256 with both
#   PART=gemv:    the FP8 GEMV's builds (rows per warp x loads in flight): FP8 GPU tests, their
#                 GB/s table, then W2 with --quantization fp8 under each ZLLM_FP8_GEMV build
#   PART=fp8gemv2: issue 40's FP8 GEMV builds, in one call of ~300 s on an H100 ($FP8GEMV2_BUDGET_S,
#                 counted from the start, the csrc build included; sm_90 cubins only, as sweep): the
#                 FP8 GEMV GPU tests (every build against float64, CUDA graph replay, the switch),
#                 the builds' GB/s at M=1 without L2 reuse (fp8_linear.py --gemv-only), W2 in bf16
#                 once (the reference), W2 --quantization fp8 with the default FP8 GEMV, then with
#                 each ZLLM_FP8_GEMV build of $FP8GEMV2_BUILDS (default: issue 40's families, the
#                 expected best first) while the budget leaves room for one more W2 (as long as the
#                 longest so far; the rest are SKIPPED). A dry run on a CPU (the shell logic, no
#                 figures): PATH=<a folder with a stub `python`> SKIP_CSRC_BUILD=1 bash ... fp8gemv2
#   PART=piecewise: W1, W2 and serve.py at Poisson 32 req/s with --no-piecewise-cuda-graphs, then
#                 with the default (piecewise CUDA graphs on), in this one call (run the GPU tests
#                 before: run_all.sh)
#   PART=prefill: the packed prefill's A/B (ZLLM_PACKED_PREFILL=0 then 1): W1, W2 and serve.py at
#                 Poisson 32 req/s, each measured back to back in this one call
#   PART=moe:     issue 18: the MoE GPU tests, benchmarks/moe_kernels.py, then W2 and W1 on the
#                 Qwen3-30B-A3B shape (dummy bf16, ~61 GB: an 80 GB H100)
#   PART=moedecode: issue 18's batch-1 decode: the MoE and GEMV GPU tests, the GEMV builds on
#                 Qwen3-30B-A3B's and Llama-3-8B's projections, the MoE kernels at batch 1-16,
#                 W2 on the Qwen3-30B-A3B shape without and with the sort-free GEMVs and each
#                 dense GEMV build
#   PART=gemvcheck: the kernel, MoE, FP8 and engine GPU tests, then benchmarks/real_model_check.py
#                 --quick --batch-one on /tmp/smol.gguf (the real weights, batch-1 decode included)
#   PART=gemvperf: W2 on Llama-3-8B with the old and the split GEMV, W2 with FP8 weights by the
#                 default FP8 GEMV and the builds in $FP8_BUILDS (default _r1u4_b6), then W2 on the
#                 Qwen3-30B-A3B shape
#   PART=decattn: issue 40 part 3, the pipelined decode attention (ZLLM_DECODE_ATTENTION): its GPU
#                 tests (tests/gpu/test_decode_attention_pipe_gpu.py), the kernel table (classic,
#                 pipe, pipe3 at batch 8/256/512 x contexts 400/1024/4096, bf16 cache; batch 256 x
#                 400/1024 over the FP8 cache; us per call and K/V TB/s), then W1 with classic and
#                 pipe (and pipe3 while $DECATTN_BUDGET_S, default 540 s from the start, leaves
#                 ~110 s). Builds sm_90 only. Estimates, not yet measured: build <= 150 s, tests
#                 ~60 s, table ~60 s, each W1 ~60 s (load, capture, ~20 s run).
#   PART=pipecheck: the pipelined decode attention (ZLLM_DECODE_ATTENTION=pipe) against classic, the
#                 check that made pipe the default (2026-11-28, docs/benchmarks.md), in the steps of $PIPECHECK_STEPS
#                 (default "tests real perf"): tests: the engine and FP8-cache GPU files with pipe
#                 (tests/gpu/test_engine_gpu.py, test_kv_cache_fp8_gpu.py, test_pdl_gpu.py; 300 s at
#                 most); real: benchmarks/real_model_check.py --quick --batch-one on /tmp/smol.gguf
#                 (../shared/gpu/NOTES.md: carried in two halves) with classic, then pipe (the real
#                 weights against HF on the same GPU); perf: W1 and W2, classic and pipe in turn,
#                 $PIPECHECK_ROUNDS rounds (default 2), while $PIPECHECK_BUDGET_S (default 560 s
#                 from the start) leaves room. Estimates: tests ~250 s, each real ~190 s, each W1
#                 ~60 s and W2 ~25 s from load to exit.
#   PART=sweep:   issue 40's rate sweep with vLLM's own client (benchmark_serving.py 0.6.3.post1,
#                 --backend openai, random dataset, 256 in / 256 out, --ignore-eos): vllm-launch with
#                 its defaults (piecewise CUDA graphs on) at Poisson 8, 16, 24, 32 and 40 req/s
#                 (300, 480, 600, 600, 600 prompts), then restarted with $SWEEP_BASELINE (default
#                 --no-piecewise-cuda-graphs) for Poisson 32 (600 prompts) as the baseline; each run's JSON saved, then
#                 benchmarks/plot_sweep.py's table and plot. Carry .whl (aiohttp and its
#                 dependencies among them) and .sdist (python benchmarks/vllm_benchmark_serving.py
#                 --download-only). Budget, whole call, from a fresh machine (estimates, not yet
#                 measured): wheels 10 s, csrc build (sm_90 only) <= 120 s, server start ~50 s, warm-up
#                 ~15 s, each rate N/rate + ~15 s (client start, its test request, the drain: 53, 45,
#                 40, 34, 30 s), restart ~60 s + warm-up, baseline ~34 s, plot 5 s: ~400 s + the build,
#                 under 9 min. Everything is bounded by $SWEEP_BUDGET_S (default 530 s from the
#                 start): a rate that no longer fits is SKIPPED, keeping ~140 s for the baseline.
#                 PASS/FAIL/TIMEOUT/SKIPPED lines. Into $OUT (five files: a device call brings
#                 back 8): build.log, sweep-summary.log (the whole output), sweep.md (the table),
#                 sweep.png, sweep-logs.tar.gz (every log, the result JSONs in sweep/).
#                 A dry run on a CPU (checks the run book, no figures): SKIP_CSRC_BUILD=1
#                 SERVE_PORT=8123 SWEEP_MODEL=~/.cache/zllm/models/SmolLM2-135M-Instruct
#                 SWEEP_SERVER_FLAGS="--max-model-len 1024" SWEEP_RATES="2 4" SWEEP_PROMPTS=6
#                 SWEEP_LEN=16 SWEEP_WARM_PROMPTS=4 bash benchmarks/gpu/run_perf.sh sweep
#   PART=servemodel: issue 40's Poisson 32 against benchmarks/serve_gpu_model.py's CPU model: vllm-launch
#                 with its defaults and ZLLM_STEP_TRACE, warmed, then vLLM's client at Poisson 32 (600 x
#                 256/256, seed 32: the sweep's prompts and gaps), the frontend's TTFT histogram before and after it,
#                 the trace against the model (serve_gpu_model.py --trace); then the same with
#                 Python's garbage collector off in the server's processes (benchmarks/gc_off).
#                 SERVEMODEL_VARIANTS picks the servers (default "default gc_off"; `nofreeze`:
#                 ZLLM_GC_FREEZE=0, the start-up heap left in the collector's walks).
#                 Carry .whl and .sdist as for sweep. Budget (estimates): build <= 120 s (none when
#                 /tmp/zllm-csrc-build is there), per server: start ~50 s, warm-up ~15 s, run ~34 s,
#                 stop ~5 s: ~220 s + the build, bounded by $SERVEMODEL_BUDGET_S (default 530 s).
#                 Into $OUT: build.log, servemodel-summary.log, servemodel-logs.tar.gz (traces,
#                 metrics, the client's JSONs).
#   PART=shard70: issue 30 part 1, where one tp 4 rank's share of Llama-3-70B spends its step, on
#                 one GPU (an H200: the share is 35 GB): copy bandwidth, W2 of the share as a whole
#                 model (dummy_model.py llama3-70b-shard4: tp 4's step less the all-reduces), its
#                 step profile at batch 1 (the kernels' ms per step), then benchmarks/gemv.py
#                 --shapes llama3-70b-tp4 (µs and TB/s per projection, zllm's builds vs cuBLAS).
#                 Estimates, not yet measured: W2 ~100 s (a 35 GB dummy load), profile ~100 s,
#                 GEMV table ~60 s, plus the build where there is none.
#   PART=envab:   an A/B of environment switches ($ENVAB_SETS) over W2 bf16 / W2 FP8 / W1 ($ENVAB_RUNS),
#                 in interleaved rounds, after the GPU tests in $ENVAB_TESTS (the part's comment says how)
#   PART=pdl:     issue 40's programmatic dependent launch (ZLLM_PDL), in one call bounded by
#                 $PDL_BUDGET_S (default 540 s from the start, the csrc build included; sm_90 cubins
#                 only): tests/gpu/test_pdl_gpu.py (the batch-1 kernels chained as a layer, each GEMV
#                 build, and decode steps of a tiny Llama through LLM, eager and graphs, bf16 and
#                 fp8: bit for bit with PDL as without), then W2 bf16 and W2 --quantization fp8 with
#                 ZLLM_PDL=0,1,0,1 interleaved, then W1 with ZLLM_PDL=0 and 1. A run that no longer
#                 fits (as long as the longest so far) is SKIPPED. Last, a table of each run's
#                 decode ms/token or output tokens/s. Estimates, not yet measured: build <= 120 s,
#                 tests ~90 s, each W2 ~25 s, each W1 ~60 s: ~530 s from a fresh machine, ~410 s
#                 with the build there (then W1 fits with room). A dry run on a CPU (the shell
#                 logic): PATH=<a folder with a stub `python`> SKIP_CSRC_BUILD=1 bash ... pdl
# Logs and JSON lines go to $OUT (default /tmp/zllm-perf).
set -uo pipefail
t0=$(date +%s)
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp/zllm-perf}"
mkdir -p "$out"
model=/tmp/zllm-llama3-8b
export ZLLM_CSRC_BUILD=/tmp/zllm-csrc-build  # fresh: a carried build dir has this machine's cmake cache
build_flags=()
[[ "${1:-}" == sweep || "${1:-}" == servemodel || "${1:-}" == fp8gemv2 || "${1:-}" == decattn || "${1:-}" == pdl || "${1:-}" == envab || "${1:-}" == pipecheck ]] && build_flags=(-DZLLM_CUBIN_ARCHS=90)  # H100/H200 only: a third of the build
[[ -n "${SKIP_CSRC_BUILD:-}" || -f $ZLLM_CSRC_BUILD/sm_90/attention_kernels.cubin ]] \
  || timeout 300 bash scripts/build_csrc.sh "$ZLLM_CSRC_BUILD" ${build_flags[@]+"${build_flags[@]}"} > "$out/build.log" 2>&1 \
  || { echo "csrc build failed (the loader falls back to what was built, or NVRTC):"; tail -15 "$out/build.log"; }
echo "csrc build: done $(( $(date +%s) - t0 )) s after the start"
python benchmarks/dummy_model.py llama3-8b "$model" >/dev/null
jsonl="$out/perf.jsonl"
run() {  # run LIMIT_S COMMAND...: JSON lines to perf.jsonl, everything to the log
  echo "== $*" | tee -a "$out/perf.log"
  timeout "$1" "${@:2}" 2>&1 | tee -a "$out/perf.log" | grep -E '^\{' | tee -a "$jsonl"
}
w1() {  # W1: 1000 x 256/256 offline
  run 200 python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
    --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 "$@"
}
w2() {  # W2: batch-1 decode
  run 150 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024 "$@"
}
serve32() {  # serve32 SUFFIX: vllm-launch under serve.py, Poisson ${RATE:-32} req/s, 600 x 256/256
  python -m zllm.launch.cli --model "$model" --load-format dummy --max-model-len 1024 --port 8000 ${SERVE_FLAGS:-} > "$out/server$1.log" 2>&1 &
  local server=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  run 150 python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model "$model" --num-prompts 600 \
    --request-rate "${RATE:-32}" --input-len 256 --output-len 256 --json "$out/serve$1.json" --plot "$out/serve$1.png"
  kill -TERM $server; wait $server
}
copy_bandwidth() {  # the device-to-device copy's TB/s (read + write), the ceiling a GEMV streams against
  run 60 python - <<'PY'
import json, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): y.copy_(x)
torch.cuda.synchronize()
print(json.dumps({"gpu": torch.cuda.get_device_name(0), "copy_TBps": round(2 * 20 * x.numel() / (time.perf_counter() - t) / 1e12, 3)}))
PY
}
case "${1:-}" in
correct)
  timeout 400 python -m pytest -q -p no:cacheprovider -rs -x -p no:warnings --tb=short tests/gpu/test_async_scheduling_gpu.py tests/gpu/test_engine_gpu.py > "$out/pytest.log" 2>&1; tail -60 "$out/pytest.log"
  ;;
latency)
  copy_bandwidth
  for mode in --async-scheduling --no-async-scheduling; do
    run 150 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024 $mode
  done
  for batch in 256 1; do
    run 150 python benchmarks/step_profile.py --model "$model" --load-format dummy --batch-size $batch --steps 50
  done
  ;;
shard70)
  shard=/tmp/zllm-llama3-70b-shard4
  python benchmarks/dummy_model.py llama3-70b-shard4 "$shard" > /dev/null
  copy_bandwidth
  run 200 python benchmarks/latency.py --model "$shard" --load-format dummy --input-len 128 --output-len 256 --iters 2 --max-model-len 1024
  run 200 python benchmarks/step_profile.py --model "$shard" --load-format dummy --batch-size 1 --steps 50 --max-model-len 1024
  run 120 python benchmarks/gemv.py --shapes llama3-70b-tp4
  ;;
load)
  for mode in --async-scheduling --no-async-scheduling; do
    run 200 python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
      --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 $mode
  done
  python -m zllm.launch.cli --model "$model" --load-format dummy --max-model-len 1024 --port 8000 > "$out/server.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done
  run 150 python benchmarks/serve.py --base-url http://127.0.0.1:8000 --model "$model" --num-prompts 400 \
    --request-rate 20 --input-len 256 --output-len 256 --json "$out/serve.json" --plot "$out/serve.png"
  kill -TERM $server; wait $server
  ;;
mix)
  w1
  run 200 python benchmarks/step_mix.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
    --max-num-batched-tokens 8192
  w2
  serve32 ""
  ;;
prefill)
  for packed in 0 1; do
    export ZLLM_PACKED_PREFILL=$packed
    echo "{\"ZLLM_PACKED_PREFILL\": $packed}" | tee -a "$jsonl"
    w1
    w2
    serve32 $packed
  done
  ;;
piecewise)
  # W1, W2 and serve.py at Poisson 32 req/s without piecewise CUDA graphs, then with them (the
  # default), back to back in this one call
  for flags in "--no-piecewise-cuda-graphs" ""; do
    echo "{\"flags\": \"${flags:-default}\"}" | tee -a "$jsonl"
    w1 $flags
    w2 $flags
    SERVE_FLAGS="$flags" serve32 "${flags:+_nopiecewise}"
  done
  ;;
fp8)
  timeout 300 python -m pytest -q -p no:cacheprovider -x -p no:warnings --tb=short tests/gpu/test_fp8_gpu.py > "$out/pytest_fp8.log" 2>&1
  tail -15 "$out/pytest_fp8.log"
  timeout 200 python benchmarks/fp8_linear.py 2>&1 | tee "$out/fp8_linear.log" | tail -45
  for q in "" "--quantization fp8"; do
    echo "{\"quantization\": \"${q:-none}\"}" | tee -a "$jsonl"
    run 150 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024 $q
    run 200 python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
      --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 $q
  done
  ;;
kvfp8)
  for flags in "" "--kv-cache-dtype fp8" "--kv-cache-dtype fp8 --quantization fp8"; do
    echo "{\"flags\": \"${flags:-none}\"}" | tee -a "$jsonl"
    run 200 python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
      --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 $flags
    [ -n "$flags" ] && run 150 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024 $flags
  done
  ;;
quant)
  timeout 200 python -m pytest -q -p no:cacheprovider -x -p no:warnings --tb=short tests/gpu/test_fp8_gpu.py > "$out/pytest_fp8.log" 2>&1
  tail -3 "$out/pytest_fp8.log"
  timeout 200 python benchmarks/fp8_linear.py --m 1,8,64,256,2048 2>&1 | tee "$out/fp8_linear.log" | tail -30
  for vec in 0 1; do
    export ZLLM_QUANT_VEC=$vec
    echo "{\"ZLLM_QUANT_VEC\": $vec}" | tee -a "$jsonl"
    run 200 python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
      --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 --quantization fp8
  done
  ;;
fp8profile)
  flags="--kv-cache-dtype fp8 --quantization fp8"
  run 200 python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
    --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 $flags
  run 150 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024 $flags
  for batch in 1 256; do
    run 150 python benchmarks/step_profile.py --model "$model" --load-format dummy --batch-size $batch --steps 50 $flags
  done
  ;;
gemv)
  timeout 200 python -m pytest -q -p no:cacheprovider -x -p no:warnings --tb=short tests/gpu/test_fp8_gpu.py > "$out/pytest_fp8.log" 2>&1
  tail -3 "$out/pytest_fp8.log"
  timeout 120 python benchmarks/fp8_linear.py --gemv-only 2>&1 | tee "$out/fp8_gemv.log" | tail -6
  for build in "" _r1u4 _r2u2 _r2u4 _r4u2; do
    export ZLLM_FP8_GEMV=$build
    echo "{\"ZLLM_FP8_GEMV\": \"${build:-default}\"}" | tee -a "$jsonl"
    run 100 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024 --quantization fp8
  done
  ;;
fp8gemv2)
  deadline=$(( t0 + ${FP8GEMV2_BUDGET_S:-300} ))
  timeout 100 python -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/gpu/test_fp8_gpu.py -k gemv \
    > "$out/pytest_fp8gemv.log" 2>&1
  echo "FP8 GEMV tests (rc $?): $(tail -1 "$out/pytest_fp8gemv.log")"
  grep -E "^(FAILED|ERROR)" "$out/pytest_fp8gemv.log" | head -20
  echo "== fp8_linear.py --gemv-only ($(( $(date +%s) - t0 )) s after the start)"
  timeout 90 python benchmarks/fp8_linear.py --gemv-only > "$out/fp8_gemv2.log" 2>&1
  grep -v '^{' "$out/fp8_gemv2.log" | tail -45
  grep -E '^\{' "$out/fp8_gemv2.log" >> "$jsonl"
  longest=0
  fp8w2() {  # fp8w2 LABEL [ENV=VALUE]...: W2 (with "$w2_flags") if the budget leaves room, timed
    local label=$1 start
    shift
    start=$(date +%s)
    if (( start + longest > deadline )); then
      echo "SKIPPED W2 $label: $(( deadline - start )) s left, a W2 took $longest s" | tee -a "$out/perf.log"
      return
    fi
    echo "{\"w2\": \"$label\"}" | tee -a "$jsonl"
    env "$@" timeout 100 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 \
      --iters 3 --max-model-len 1024 $w2_flags 2>&1 | tee -a "$out/perf.log" | grep -E '^\{' | tee -a "$jsonl"
    (( $(date +%s) - start > longest )) && longest=$(( $(date +%s) - start ))
  }
  w2_flags=""
  fp8w2 bf16 ZLLM_FP8_GEMV=
  w2_flags="--quantization fp8"
  fp8w2 "fp8 default" ZLLM_FP8_GEMV=
  for build in ${FP8GEMV2_BUILDS:-_mma_g2u2x _mma_g1u4x _mma_g2u4x _mma_g1u8x _mma_g2u2 _mma_g1u4 _split}; do
    fp8w2 "fp8 $build" ZLLM_FP8_GEMV=$build
  done
  echo "== fp8gemv2: $(( $(date +%s) - t0 )) s"
  ;;
envab)
  # A/B of environment switches in one call (bounded by $ENVAB_BUDGET_S, default 540 s from the
  # start): first the GPU tests named in $ENVAB_TESTS (if any, 200 s at most), then for each of
  # $ENVAB_ROUNDS rounds (default 2), each workload of $ENVAB_RUNS ("w2" bf16 batch-1 decode, "w2fp8"
  # the same with --quantization fp8, "w1" the offline 1000 x 256/256), each setting of $ENVAB_SETS
  # in turn: settings separated by ";", each "LABEL:VAR=VALUE VAR=VALUE" (LABEL alone: as is).
  # Example: ENVAB_SETS="base;attn:ZLLM_PDL_ATTENTION=1;pf:ZLLM_GEMV_PREFETCH=1". A run that no
  # longer fits (as long as the longest so far) is SKIPPED. Last, a table of every run.
  deadline=$(( t0 + ${ENVAB_BUDGET_S:-540} ))
  if [[ -n "${ENVAB_TESTS:-}" ]]; then
    timeout 200 python -m pytest -q -p no:cacheprovider -p no:warnings -rs --tb=short $ENVAB_TESTS > "$out/pytest_envab.log" 2>&1
    echo "envab tests (rc $?, $(( $(date +%s) - t0 )) s after the start): $(tail -1 "$out/pytest_envab.log")"
    grep -E "^(FAILED|ERROR)" "$out/pytest_envab.log" | head -20
  fi
  IFS=';' read -ra sets <<< "${ENVAB_SETS:-base}"
  longest=0
  for round in $(seq "${ENVAB_ROUNDS:-2}"); do
    for workload in ${ENVAB_RUNS:-w2 w2fp8}; do
      case $workload in
        w2) cmd=(python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024) ;;
        w2fp8) cmd=(python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024 --quantization fp8) ;;
        w1) cmd=(python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192) ;;
        *) echo "envab: unknown workload $workload"; continue ;;
      esac
      for set in "${sets[@]}"; do
        label=${set%%:*} assignments=""
        [[ $set == *:* ]] && assignments=${set#*:}
        start=$(date +%s)
        if (( start + longest > deadline || start + 30 > deadline )); then
          echo "SKIPPED $workload $label (round $round): $(( deadline - start )) s left, a run took $longest s" | tee -a "$out/perf.log"
          continue
        fi
        echo "{\"envab\": \"$workload\", \"set\": \"$label\", \"round\": $round, \"env\": \"$assignments\"}" | tee -a "$jsonl"
        env $assignments timeout 200 "${cmd[@]}" 2>&1 | tee -a "$out/perf.log" | grep -E '^\{' | tee -a "$jsonl"
        (( $(date +%s) - start > longest )) && longest=$(( $(date +%s) - start ))
      done
    done
  done
  echo "== envab table (workload, set, round: W2 decode ms/token or W1 requests/s):"
  python - "$jsonl" <<'PY'
import json, sys
label = None
for line in open(sys.argv[1]):
    try:
        row = json.loads(line)
    except ValueError:
        continue
    if "envab" in row:
        label = f"{row['envab']:6s} {row['set']:12s} round {row['round']}"
    elif label and ("decode_ms_per_token" in row or "requests_per_s" in row):
        print(label, row.get("decode_ms_per_token", row.get("requests_per_s")))
        label = None
PY
  echo "== envab: $(( $(date +%s) - t0 )) s"
  ;;
pdl)
  deadline=$(( t0 + ${PDL_BUDGET_S:-540} ))
  timeout 200 python -m pytest -q -p no:cacheprovider -p no:warnings -rs --tb=short tests/gpu/test_pdl_gpu.py \
    > "$out/pytest_pdl.log" 2>&1
  echo "PDL tests (rc $?, $(( $(date +%s) - t0 )) s after the start): $(tail -1 "$out/pytest_pdl.log")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$out/pytest_pdl.log" | head -20
  longest=0
  pdlrun() {  # pdlrun LABEL SWITCH LIMIT_S COMMAND...: one run with ZLLM_PDL=SWITCH if the budget leaves room
    local label=$1 switch=$2 limit=$3 start
    shift 3
    start=$(date +%s)
    if (( start + longest > deadline || start + 30 > deadline )); then
      echo "SKIPPED $label ZLLM_PDL=$switch: $(( deadline - start )) s left, a run took $longest s" | tee -a "$out/perf.log"
      return
    fi
    echo "{\"pdl_run\": \"$label\", \"ZLLM_PDL\": $switch}" | tee -a "$jsonl"
    ZLLM_PDL=$switch timeout "$limit" "$@" 2>&1 | tee -a "$out/perf.log" | grep -E '^\{' | tee -a "$jsonl"
    (( $(date +%s) - start > longest )) && longest=$(( $(date +%s) - start ))
  }
  w2cmd=(python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024)
  for switch in 0 1 0 1; do
    pdlrun "W2 bf16" $switch 100 "${w2cmd[@]}"
    pdlrun "W2 fp8" $switch 100 "${w2cmd[@]}" --quantization fp8
  done
  longest=$(( longest > 90 ? longest : 90 ))  # a W1 takes longer than a W2: keep room for one
  for switch in 0 1; do
    pdlrun "W1 bf16" $switch 200 python benchmarks/throughput.py --model "$model" --load-format dummy --num-prompts 1000 \
      --input-len 256 --output-len 256 --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192
  done
  echo "== pdl table (run, ZLLM_PDL, W2 decode ms/token or W1 output tokens/s):"
  python - "$jsonl" <<'PY'
import json, sys
label = None
for line in open(sys.argv[1]):
    try:
        row = json.loads(line)
    except ValueError:
        continue
    if "pdl_run" in row:
        label = f"{row['pdl_run']:8s} PDL={row['ZLLM_PDL']}"
    elif label and ("decode_ms_per_token" in row or "output_tokens_per_s" in row):
        print(label, row.get("decode_ms_per_token", row.get("output_tokens_per_s")))
        label = None
PY
  echo "== pdl: $(( $(date +%s) - t0 )) s"
  ;;
moe)
  timeout 400 python -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/gpu/test_moe_gpu.py > "$out/pytest_moe.log" 2>&1
  grep -E "passed|failed|Error|assert" "$out/pytest_moe.log" | tail -25
  run 200 python benchmarks/moe_kernels.py
  moe=/tmp/zllm-qwen3-30b-a3b
  python benchmarks/dummy_model.py qwen3-30b-a3b "$moe" >/dev/null
  run 150 python benchmarks/latency.py --model "$moe" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024
  run 250 python benchmarks/throughput.py --model "$moe" --load-format dummy --num-prompts 1000 --input-len 256 --output-len 256 \
    --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192
  ;;
moedecode)
  timeout 400 python -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/gpu/test_moe_gpu.py "tests/gpu/test_kernels.py::test_gemv" > "$out/pytest_moe.log" 2>&1
  grep -E "passed|failed|Error|assert" "$out/pytest_moe.log" | tail -25
  run 100 python benchmarks/gemv.py --shapes qwen3-30b-a3b
  run 100 python benchmarks/gemv.py --shapes llama3-8b
  run 200 python benchmarks/moe_kernels.py --batches 1 2 4 8 16 --loop-batches
  moe=/tmp/zllm-qwen3-30b-a3b
  python benchmarks/dummy_model.py qwen3-30b-a3b "$moe" >/dev/null
  # W2 on the Qwen3-30B-A3B shape: the sort + tiles at every batch (before), then the sort-free
  # MoE GEMVs with the dense GEMV one warp a row, and with the split dense GEMV of each bound.
  for setting in "ZLLM_MOE_GEMV_PAIRS=0" "ZLLM_GEMV_BOUND=" "ZLLM_GEMV_BOUND=b4" "ZLLM_GEMV_BOUND=b6"; do
    echo "{\"setting\": \"$setting\"}" | tee -a "$jsonl"
    env "$setting" timeout 150 python benchmarks/latency.py --model "$moe" --load-format dummy --input-len 128 \
      --output-len 256 --iters 3 --max-model-len 1024 2>&1 | tee -a "$out/perf.log" | grep -E '^\{' | tee -a "$jsonl"
  done
  ;;
gemvcheck)
  # The GPU tests of every kernel the GEMV builds touch, then the real SmolLM2 weights against HF
  # (needs /tmp/smol.gguf: ../shared/gpu/NOTES.md), batch-1 decode included.
  timeout 400 python -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/gpu/test_kernels.py tests/gpu/test_moe_gpu.py \
    tests/gpu/test_fp8_gpu.py tests/gpu/test_engine_gpu.py > "$out/pytest_gemv.log" 2>&1
  grep -E "passed|failed|Error|assert" "$out/pytest_gemv.log" | tail -25
  run 300 python benchmarks/real_model_check.py --model /tmp/smol.gguf --quick --batch-one
  ;;
pipecheck)
  steps=" ${PIPECHECK_STEPS:-tests real perf} "
  deadline=$(( t0 + ${PIPECHECK_BUDGET_S:-560} ))
  if [[ $steps == *" tests "* ]]; then
    ZLLM_DECODE_ATTENTION=pipe timeout 300 python -m pytest -q -p no:cacheprovider -p no:warnings -rs --tb=short \
      tests/gpu/test_engine_gpu.py tests/gpu/test_kv_cache_fp8_gpu.py tests/gpu/test_pdl_gpu.py > "$out/pytest_pipecheck.log" 2>&1
    echo "pipecheck tests with pipe (rc $?, $(( $(date +%s) - t0 )) s after the start): $(tail -1 "$out/pytest_pipecheck.log")"
    grep -E "^(FAILED|ERROR)" "$out/pytest_pipecheck.log" | head -20
  fi
  if [[ $steps == *" real "* ]]; then
    if [[ -f /tmp/smol.gguf ]]; then
      for build in classic pipe; do
        echo "{\"real_model_check\": \"$build\"}" | tee -a "$jsonl"
        ZLLM_DECODE_ATTENTION=$build run 300 python benchmarks/real_model_check.py --model /tmp/smol.gguf --quick --batch-one
      done
    else
      echo "SKIPPED real: no /tmp/smol.gguf (../shared/gpu/NOTES.md: the GGUF in two halves)"
    fi
  fi
  if [[ $steps == *" perf "* ]]; then
    for round in $(seq "${PIPECHECK_ROUNDS:-2}"); do
      for build in classic pipe; do
        for workload in w1 w2; do
          need=$([[ $workload == w1 ]] && echo 70 || echo 35)
          if (( $(date +%s) + need > deadline )); then
            echo "SKIPPED $workload $build (round $round): $(( deadline - $(date +%s) )) s left"
            continue
          fi
          echo "{\"pipecheck\": \"$workload\", \"ZLLM_DECODE_ATTENTION\": \"$build\", \"round\": $round}" | tee -a "$jsonl"
          ZLLM_DECODE_ATTENTION=$build $workload
        done
      done
    done
  fi
  echo "pipecheck: $(( $(date +%s) - t0 )) s"
  ;;
gemvperf)
  # W2 on Llama-3-8B: the one-warp-per-row GEMV (before) and the split b6 build (the default);
  # with FP8 weights, the default FP8 GEMV and $FP8_BUILDS; then W2 on Qwen3-30B-A3B.
  for setting in "ZLLM_GEMV_BOUND=" "ZLLM_GEMV_BOUND=b6"; do
    echo "{\"setting\": \"$setting\"}" | tee -a "$jsonl"
    env "$setting" timeout 100 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 \
      --iters 3 --max-model-len 1024 2>&1 | tee -a "$out/perf.log" | grep -E '^\{' | tee -a "$jsonl"
  done
  for build in "" ${FP8_BUILDS:-_r1u4_b6}; do
    echo "{\"ZLLM_FP8_GEMV\": \"${build:-default}\"}" | tee -a "$jsonl"
    ZLLM_FP8_GEMV=$build run 100 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 --output-len 256 \
      --iters 3 --max-model-len 1024 --quantization fp8
  done
  moe=/tmp/zllm-qwen3-30b-a3b
  python benchmarks/dummy_model.py qwen3-30b-a3b "$moe" >/dev/null
  run 150 python benchmarks/latency.py --model "$moe" --load-format dummy --input-len 128 --output-len 256 --iters 3 --max-model-len 1024
  ;;
decattn)
  timeout 200 python -m pytest -q -p no:cacheprovider -p no:warnings --tb=short tests/gpu/test_decode_attention_pipe_gpu.py \
    > "$out/pytest_decattn.log" 2>&1
  echo "pytest (exit $?): $(grep -E '[0-9]+ (passed|failed|error)' "$out/pytest_decattn.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$out/pytest_decattn.log" | head -20
  run 150 python benchmarks/attention_decode.py --batch-sizes 8,256,512 --contexts 400,1024,4096 --partition-sizes default \
    --builds classic,pipe,pipe3
  run 60 python benchmarks/attention_decode.py --batch-sizes 256 --contexts 400,1024 --partition-sizes default \
    --builds classic,pipe,pipe3 --kv-cache-dtype fp8
  for build in classic pipe pipe3; do
    if [[ $build == pipe3 ]] && (( $(date +%s) - t0 > ${DECATTN_BUDGET_S:-540} - 110 )); then
      echo "SKIPPED W1 with pipe3 ($(( $(date +%s) - t0 )) s gone of ${DECATTN_BUDGET_S:-540})"
      continue
    fi
    export ZLLM_DECODE_ATTENTION=$build
    echo "{\"ZLLM_DECODE_ATTENTION\": \"$build\"}" | tee -a "$jsonl"
    w1
  done
  echo "decattn: $(( $(date +%s) - t0 )) s"
  ;;
sweep)
  source benchmarks/gpu/env.sh  # the carried wheels: aiohttp for vLLM's client
  source benchmarks/gpu/lib.sh
  # Into $OUT: sweep-summary.log (the whole output), sweep.md, sweep.png and, at the end,
  # sweep-logs.tar.gz (every log and result file, from the working folder /tmp/zllm-sweep).
  dest=$out
  out=/tmp/zllm-sweep
  rm -rf "$out"
  mkdir -p "$out"
  exec > >(tee -a "$dest/sweep-summary.log") 2>&1
  deadline=$(( t0 + ${SWEEP_BUDGET_S:-530} ))
  need_client_files || exit 1
  # SWEEP_* change the workload for a dry run on a CPU (docs/benchmarks.md), never for figures.
  sweep_model=${SWEEP_MODEL:-$model}
  read -ra server_flags <<< "--model $sweep_model ${SWEEP_SERVER_FLAGS---load-format dummy --max-model-len 1024}"
  read -ra rates <<< "${SWEEP_RATES:-8 16 24 32 40}"
  len=${SWEEP_LEN:-256}
  sweep="$out/sweep"
  rm -rf "$sweep"
  mkdir -p "$sweep"
  client=(--model "$(basename "$sweep_model")" --tokenizer "$sweep_model" --random-input-len "$len" --random-output-len "$len" --ignore-eos)
  # A seed per run: the client draws its prompts from numpy's seed, and runs of one size with one
  # seed send the same prompts, which the prefix cache (on by default, 150k tokens of 600 prompts
  # fit in it) would then serve. The baseline repeats the default run's rate-32 prompts, on a
  # fresh server.
  warm() {  # 64 requests at once: every step kind, both prefill chunk sizes, before anything is timed
    vllm_client "sweep-warm-$1" 120 "${client[@]}" --num-prompts "${SWEEP_WARM_PROMPTS:-64}" --request-rate inf --seed 1000
  }
  reserve=140  # the baseline: restart (~60 s), warm-up, Poisson 32 (~34 s), stops
  if serve_start default 180 "${server_flags[@]}"; then
    warm default
    for rate in "${rates[@]}"; do
      case $rate in 8) n=300 ;; 16) n=480 ;; *) n=600 ;; esac
      n=${SWEEP_PROMPTS:-$n}
      expected=$(( n / rate + 15 ))
      fits "sweep-rate$rate" $expected $reserve || continue
      vllm_client "sweep-rate$rate" $(( 2 * expected + 60 )) "${client[@]}" --num-prompts "$n" --request-rate "$rate" --seed "$rate" \
        --save-result --result-dir "$sweep" --result-filename "rate$rate.json" --metadata label=default
    done
    serve_stop 60
    verdict "server-default stop" $?
  fi
  # The baseline server's flags: SWEEP_BASELINE (default: the pieces off; "--mixed-graph-max-tokens 0"
  # compares against steps with prefill always on the pieces, the default before the decode-graph rows).
  read -ra baseline_flags <<< "${SWEEP_BASELINE:---no-piecewise-cuda-graphs}"
  baseline_label=$(IFS=_; echo "${baseline_flags[*]}" | tr -d '-')
  if fits "sweep-baseline" $(( reserve - 20 )) && serve_start baseline 180 "${server_flags[@]}" "${baseline_flags[@]}"; then
    warm baseline
    n=${SWEEP_PROMPTS:-600}
    vllm_client sweep-rate32-baseline $(( 2 * (n / 32 + 15) + 60 )) "${client[@]}" --num-prompts "$n" --request-rate 32 --seed 32 \
      --save-result --result-dir "$sweep" --result-filename "rate32_$baseline_label.json" --metadata "label=$baseline_label"
    serve_stop 60
    verdict "server-baseline stop" $?
  fi
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1)
  timeout 60 python benchmarks/plot_sweep.py "$sweep" --plot "$dest/sweep.png" \
    --title "$(basename "$sweep_model") (${gpu:-no GPU}): vLLM's benchmark_serving.py, random $len in / $len out" \
    | tee "$dest/sweep.md"
  pack_results "$dest" sweep
  echo "== sweep: $( ((status == 0)) && echo 'all passed' || echo 'SOMETHING FAILED OR WAS SKIPPED (see above)'), $(( $(date +%s) - t0 )) s"
  exit $status
  ;;
servemodel)
  source benchmarks/gpu/env.sh
  source benchmarks/gpu/lib.sh
  dest=$out
  out=/tmp/zllm-servemodel
  rm -rf "$out"
  mkdir -p "$out"
  exec > >(tee -a "$dest/servemodel-summary.log") 2>&1
  deadline=$(( t0 + ${SERVEMODEL_BUDGET_S:-530} ))
  need_client_files || exit 1
  read -ra server_flags <<< "--model $model --load-format dummy --max-model-len 1024"
  client=(--model "$(basename "$model")" --tokenizer "$model" --random-input-len 256 --random-output-len 256 --ignore-eos)
  echo "== the model's prediction (CPU): python benchmarks/serve_gpu_model.py --rates 32 --table"
  python benchmarks/serve_gpu_model.py --rates 32 --table
  for variant in ${SERVEMODEL_VARIANTS:-default gc_off}; do
    extra=$PYTHONPATH
    [[ $variant == gc_off ]] && extra="$PWD/benchmarks/gc_off:$PYTHONPATH"
    freeze=1
    [[ $variant == nofreeze ]] && freeze=0  # the collector as Python sets it (before ZLLM_GC_FREEZE)
    fits "servemodel-$variant" 110 || continue
    if PYTHONPATH=$extra ZLLM_GC_FREEZE=$freeze ZLLM_STEP_TRACE="$out/trace-$variant" serve_start "$variant" 180 "${server_flags[@]}"; then
      vllm_client "servemodel-warm-$variant" 120 "${client[@]}" --num-prompts 64 --request-rate inf --seed 1000
      scrape() { curl -sf "http://127.0.0.1:$PORT/metrics" | grep -E "^zllm:(time_to_first_token|inter_token)" > "$out/metrics-$variant-$1.txt"; }
      scrape before  # the warm-up's 64 at once are in the histograms too: subtract these
      vllm_client "servemodel-rate32-$variant" 140 "${client[@]}" --num-prompts 600 --request-rate 32 --seed 32 \
        --save-result --result-dir "$out" --result-filename "rate32-$variant.json" --metadata label=$variant
      scrape after
      grep -E "time_to_first_token_seconds_(bucket\{.*le=\"(0.1|0.25|0.5)\"|count)" "$out/metrics-$variant-"*.txt | sed 's/^/    /'
      serve_stop 60
      verdict "server-$variant stop" $?
      python benchmarks/serve_gpu_model.py --trace "$out/trace-$variant" | tee "$out/compare-$variant.json"
      python benchmarks/step_trace_summary.py "$out/trace-$variant" --since-last-idle > "$out/summary-$variant.jsonl"
    fi
  done
  pack_results "$dest" servemodel
  echo "== servemodel: $( ((status == 0)) && echo 'all passed' || echo 'SOMETHING FAILED OR WAS SKIPPED (see above)'), $(( $(date +%s) - t0 )) s"
  exit $status
  ;;
*) echo "usage: $0 correct|latency|load|mix|prefill|fp8|kvfp8|quant|fp8profile|gemv|fp8gemv2|pdl|moe|moedecode|gemvcheck|gemvperf|decattn|pipecheck|sweep|servemodel"; exit 2 ;;
esac
