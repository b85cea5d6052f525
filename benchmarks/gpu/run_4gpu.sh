#!/usr/bin/env bash
# On nvidia-h100-x4 (it may come as 4 x H200; the first lines say which): issue 30's four-GPU
# figures and checks, one PART per device call, each under 9 minutes.
# Usage: bash benchmarks/gpu/run_4gpu.sh dp|dptrace|tp2dp2|exit|serve70b|ar70b|tails70b|dpserve|symm4|arnorm|lamport|w2ab70
#
#   dp:       W1 (benchmarks/throughput.py, 1000 x 256/256 offline, Llama-3-8B shape, dummy bf16,
#             run_perf.sh's flags) at --dp 1, 2 and 4 (one GPU per engine), then the scaling
#             ratios against dp 1. Estimate: each W1 ~40 s start + 20 s (dp 1) .. 6 s (dp 4) + stop:
#             ~200 s, plus the csrc build.
#   dptrace:  where dp 2's time goes (issue 30), every run with ZLLM_STEP_TRACE (a JSON line per
#             step of every engine core and worker): W1 at --dp 2; one engine alone with a dp 2
#             engine's share (500 prompts) and a dp 4 engine's (250); --dp 4; --dp 2 with
#             --max-num-seqs 256 (each engine at dp 4's batch, two waves); --dp 1; --dp 2 on GPUs 2
#             and 3 (CUDA_VISIBLE_DEVICES=2,3). After each, benchmarks/step_trace_summary.py's rows
#             per engine and per worker (the steady decode period, and how much of it the worker
#             sat blocked on the device: sync_ms). Traces in the logs tarball. Estimate: seven W1
#             of ~40 s start + 5-22 s each: ~400 s, plus the build (run with BUDGET_S=580 on a
#             machine where csrc is built already, or accept that the last runs are SKIPPED).
#   tp2dp2:   correctness first: benchmarks/tp_agreement.py in fp32, tp 2 x dp 2 against tp 1, 32
#             prompts of 64 in / 128 out, every request must be identical (--require-equal); then
#             W1 at tp 2 x dp 2 (bf16). Estimate: ~150 s (two fp32 starts) + ~70 s, plus the build.
#   exit:     clean exits at tp 4 (Llama-3.2-1B shape, dummy bf16): vllm-launch --tp 4, wait for
#             /health, one request, SIGTERM; checks exit code 0, no "destroy_process_group() was
#             not called" warning on its stderr, every rank logged leaving its group, no process left on any
#             GPU. Then again, but with kill -9 of rank 1's worker after the first request: the
#             engine must restart (a request served by new workers) before the SIGTERM and the
#             same checks. Estimate: three starts of ~30 s, restart wait, stops: ~150 s + the build.
#   serve70b: vllm-launch --tp 4 on the Llama-3-70B shape (dummy bf16, prefix caching off: see
#             below) under vLLM's client (random dataset, --ignore-eos): batch 1 (6 runs of one
#             prompt each, 128 in / 256 out, one after another: 0.6.3's client has no
#             --max-concurrency), Poisson 4 req/s (200 prompts) and Poisson 12 req/s (480), 256/256;
#             benchmarks/plot_sweep.py's table of the three; then W2 (latency.py --tp 4, batch 1,
#             128/256) offline in the same call. Estimate: start ~90 s, warm-up 15 s, batch 1
#             ~70 s, Poisson 4 ~65 s, Poisson 12 ~60 s, stop, W2 ~110 s: ~420 s, plus the build
#             (run the parts back to back on one warm machine: the first builds csrc in /tmp and
#             the others reuse it). Prefix caching is off for this server (SERVE70B_FLAGS) because
#             each one-prompt run of the client sends its prompt twice (its "initial test run" is
#             request 0), and the second would be a cache hit; the random prompts share nothing
#             else, so the Poisson runs lose nothing by it.
#   ar70b:    issue 30 items 1 and 2 at tp 4, Llama-3-70B shape (dummy bf16): W2 (latency.py, batch
#             1, 128/256, 2 iterations) with NCCL, then with the symmetric-memory one-shot
#             all-reduce up to $AR_MAX (default 1MiB), and W2 of one rank's share as a whole model on
#             one GPU (dummy_model.py llama3-70b-shard4: tp 4's step less the all-reduces and the
#             peers); then benchmarks/served_itl.py --trace at tp 4
#             (offline engine, then vllm-launch over HTTP; 3 requests each after a warm-up, prefix
#             caching off) for where the served path loses time. Estimate: 3 x ~100 s + 2 starts.
#             AR70B_RUNS picks a subset of "nccl symm shard itl" (default all four).
#   tails70b: issue 30 item 3: vllm-launch --tp 4 on the 70B shape under vLLM's client at Poisson 4
#             (200 prompts) and 12 (480), 256/256, once per token budget in $TAIL_BUDGETS (default
#             "2048 512": the default and a chunk that a 70B step at tp 4 computes in ~30 ms);
#             $TAIL_FLAGS go to every server, $TAIL_RATES (default "4:200 12:480") picks the loads.
#             Each server runs with ZLLM_STEP_TRACE; step_trace_summary.py --by-prefill then gives
#             its step periods by the prompt tokens a step carried. Table in $OUT/tails70b.md.
#             Estimate: ~220 s a budget.
#   dpserve:  issue 30 item 4: `vllm-launch -dp 4 --api-server-count C` (8B shape) for each C in
#             $DP_API_COUNTS (default "1 4") under vLLM's client at Poisson $DP_RATE (default 120)
#             with $DP_PROMPTS (2400) x 256/256, each with every process's CPU share per second
#             (benchmarks/proc_cpu.py) and a py-spy profile of a frontend (carry the py-spy wheel);
#             then served_itl.py at tp 1 (8B, GPU 0) if time is left. DP_TRACES=1 first repeats
#             the three dp 2 traces (dp 2; one engine with 500 prompts; dp 2 on GPUs 2 and 3).
#             Estimate: ~100 s a count, ~120 s served_itl, ~210 s the traces.
#   arnorm:   issue 30 item 1, the fused all-reduce + residual add + RMSNorm (ZLLM_ALLREDUCE_NORM,
#             off by default, never run on a GPU before): tests/gpu/test_allreduce_norm_gpu.py
#             (2 and 4 ranks, bf16/fp32, eager and graph replays; the engine's fp32 tokens at tp 2 with
#             it on = off), then W2 of the 70B shape at tp 4 with the one-shot all-reduce and the switch
#             0, then 1. ZLLM_DEBUG_HANG_S=120. Estimate: tests ~200 s, 2 x W2 ~100 s each + the build.
#   lamport:  issue 30 item 1, zllm's barrier-free Lamport all-reduce (ZLLM_ALLREDUCE_LAMPORT: on
#             by default at tp 2 and 4 since it ran on 2 and 4 x H200, 2026-11-28; tp 8 not yet run), in
#             $LAMPORT_STEPS (default "tests bench w2"; "tpfiles" adds the multi-GPU engine files
#             under the defaults: tensor parallel, Ray, pooling at tp 2; more than 420 s on 4 x H200,
#             bounded by $TPFILES_LIMIT_S, default 560: a call of its own):
#             tests: tests/gpu/test_lamport_all_reduce_gpu.py (2/4/8 ranks, bf16/fp32, PDL on/off,
#             sizes growing and shrinking, ranks held back, negative zeros, graph replays; the
#             engine's fp32 tokens at tp 2 with it and its fused norm = the one-shot kernel's) and
#             the lamport cases of test_allreduce_norm_gpu.py (the fused form, bit for bit);
#             bench: benchmarks/all_reduce.py at tp 2 and tp 4 (us per all-reduce in CUDA graphs:
#             NCCL, PyTorch's one-shot, Lamport); w2: W2 of the 70B shape at tp 4 under each of
#             $LAMPORT_SETS (default: the one-shot kernel, Lamport, Lamport with the fused norm).
#             ZLLM_DEBUG_HANG_S=120. Estimate: tests ~250 s, bench ~80 s, each W2 ~100 s: two calls
#             (the second with LAMPORT_STEPS=w2 if the first ran out).
#   w2ab70:   issue 30 item 1's switches A/B: first the single-GPU tests in $W2AB_TESTS on GPU 0
#             (default: the PDL chain with attention, the fused GEMV epilogues; 200 s at most), then
#             W2 of the 70B shape at tp 4 (one-shot all-reduce) for each setting of $W2AB_SETS
#             ("LABEL:VAR=VALUE VAR=VALUE;...", as run_perf.sh envab; default: both GEMV epilogues
#             off, the defaults, PDL attention, the fused all-reduce + norm, all), $W2AB_ROUNDS rounds (1).
#             Estimate: ~100 s a W2 (load, capture, 2 iterations).
#   symm4:    is the symmetric-memory all-reduce correct at tp 2 and tp 4 (before it becomes the
#             default): tests/gpu/test_tensor_parallel_gpu.py -- the one-shot kernel against NCCL on
#             2 and 4 ranks (eager and in graph replays), the engine's tokens with it (tp 2: = NCCL's
#             in bf16 and fp32; tp 4: = HF's in fp32), and tp 4 fp32 = HF with NCCL. ZLLM_DEBUG_HANG_S
#             prints every thread's stack if a barrier never meets. Estimate: ~300 s.
#
# Carry .whl (pyzmq, msgspec, xgrammar and its needs, aiohttp and its dependencies: run_all.sh's
# header) and .sdist (vLLM's client for exit/serve70b: python benchmarks/vllm_benchmark_serving.py
# --download-only). Every command runs under `timeout`, all within $BUDGET_S (default 530 s)
# from the start; each step prints PASS/FAIL/TIMEOUT/SKIPPED. Into $OUT (default /tmp/zllm-4gpu),
# at most four files: 4gpu-PART.log (the whole output), 4gpu-PART.jsonl (the JSON lines),
# serve70b.md, 4gpu-PART-logs.tar.gz (every log and result). Exits 1 if anything failed or was
# skipped.
# A dry run on a CPU checks the run book, not the figures: DRY_MODEL=<a tiny HF Llama directory
# with 4 heads, 2 KV heads> stands for every model, SKIP_CSRC_BUILD=1, SERVE_PORT=8123, an
# nvidia-smi on PATH that prints nothing; for `exit` also EXIT_TP=2 EXIT_SERVER_FLAGS="--dtype
# float32 --max-model-len 256 --kv-cache-memory 64MiB", for `dp` W1_PROMPTS=64.
set -uo pipefail
t0=$(date +%s)
cd "$(dirname "$0")/../.."
part="${1:-}"
parts="dp|dptrace|tp2dp2|exit|serve70b|ar70b|tails70b|dpserve|symm4|arnorm|lamport|w2ab70"
[[ "|$parts|" == *"|$part|"* && -n "$part" ]] || { echo "usage: $0 $parts"; exit 2; }
# Into $OUT (a device call brings back 8 files): 4gpu-PART.log (the whole output), 4gpu-PART.jsonl,
# serve70b.md (serve70b) and, at the end, 4gpu-PART-logs.tar.gz (every log and result file, from
# the working folder /tmp/zllm-4gpu-PART).
dest="${OUT:-/tmp/zllm-4gpu}"
out=/tmp/zllm-4gpu-$part
rm -rf "$out"
mkdir -p "$dest" "$out"
exec > >(tee -a "$dest/4gpu-$part.log") 2>&1
jsonl="$dest/4gpu-$part.jsonl"
deadline=$(( t0 + ${BUDGET_S:-530} ))
source benchmarks/gpu/env.sh
source benchmarks/gpu/lib.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1
env | grep -E '^(NCCL_|CUDA_VISIBLE)' || echo "(no NCCL_* or CUDA_VISIBLE_DEVICES set)"
export ZLLM_CSRC_BUILD=/tmp/zllm-csrc-build  # fresh here; reused by later parts on the same warm machine
if [[ -z "${SKIP_CSRC_BUILD:-}" && ! -f $ZLLM_CSRC_BUILD/sm_90/attention_kernels.cubin ]]; then
  bounded csrc-build 240 bash scripts/build_csrc.sh "$ZLLM_CSRC_BUILD" -DZLLM_CUBIN_ARCHS=90 \
    || echo "   (the kernel loader falls back to what was built, or NVRTC)"
fi
m8b=${DRY_MODEL:-/tmp/zllm-llama3-8b}
dummy() {  # dummy SHAPE DIR: write the dummy model directory (not for a dry run)
  [[ -n "${DRY_MODEL:-}" ]] || python benchmarks/dummy_model.py "$1" "$2" > /dev/null
}
w1() {  # w1 NAME LIMIT_S FLAGS...: run_perf.sh's W1 (1000 x 256/256 offline)
  bounded "$1" "$2" python benchmarks/throughput.py --model "$m8b" --load-format dummy --num-prompts "${W1_PROMPTS:-1000}" \
    --input-len 256 --output-len 256 --no-detokenize --quiet --max-model-len 1024 --max-num-batched-tokens 8192 "${@:3}"
  gpus_free 30 || { echo "FAIL $1: GPU memory still held after it exited"; status=1; }
}
traced() {  # traced NAME FLAGS...: W1 with a step trace under $out/trace-NAME, then its summary
  export ZLLM_STEP_TRACE="$out/trace-$1"
  w1 "w1-$1" 200 "${@:2}"
  unset ZLLM_STEP_TRACE
  python benchmarks/step_trace_summary.py "$out/trace-$1" --since-last-idle 2>&1 | tee "$out/summary-$1.jsonl"
}
m70b=${DRY_MODEL:-/tmp/zllm-llama3-70b}
client70b=(--model "$(basename "$m70b")" --tokenizer "$m70b" --ignore-eos)

case "$part" in
dp)
  dummy llama3-8b "$m8b"
  for dp in 1 2 4; do
    w1 "w1-dp$dp" 200 --dp "$dp"
  done
  echo "== W1 by data-parallel size (requests/s; ideal scaling is dp x)"
  python - "$out" << 'PY'
import json, pathlib, sys

out, rows = pathlib.Path(sys.argv[1]), {}
for dp in (1, 2, 4):
    log = out / f"w1-dp{dp}.log"
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")] if log.exists() else []
    if lines:
        rows[dp] = lines[-1]
print("| dp | req/s | output tok/s | elapsed | vs dp 1 |")
print("|---:|---:|---:|---:|---:|")
for dp, row in rows.items():
    ratio = f"{row['requests_per_s'] / rows[1]['requests_per_s']:.2f}x" if 1 in rows else "n/a"
    print(f"| {dp} | {row['requests_per_s']} | {row['output_tokens_per_s']} | {row['elapsed_s']} s | {ratio} |")
PY
  ;;
dptrace)
  dummy llama3-8b "$m8b"
  # Most telling first: a dp 2 engine against one engine given its 500 (or dp 4's 250) requests alone.
  traced dp2 --dp 2
  all=${W1_PROMPTS:-1000}
  W1_PROMPTS=$(( all / 2 )) traced dp1-half --dp 1
  traced dp4 --dp 4
  W1_PROMPTS=$(( all / 4 )) traced dp1-quarter --dp 1
  traced dp2-seqs256 --dp 2 --max-num-seqs 256
  traced dp1 --dp 1
  CUDA_VISIBLE_DEVICES=2,3 traced dp2-gpus23 --dp 2
  ;;
tp2dp2)
  dummy llama3-8b "$m8b"
  bounded agree-tp2dp2-fp32 300 python benchmarks/tp_agreement.py --model "$m8b" --load-format dummy --dtype float32 \
    --tp 2 --dp 2 --num-prompts 32 --input-len 64 --output-len 128 --max-model-len 1024 --require-equal
  gpus_free 30 || { echo "FAIL agree-tp2dp2-fp32: GPU memory still held after it exited"; status=1; }
  w1 w1-tp2dp2 240 --tp 2 --dp 2
  ;;
exit)
  exit_model=${DRY_MODEL:-/tmp/zllm-llama3.2-1b}
  exit_tp=${EXIT_TP:-4}
  read -ra exit_flags <<< "--tp $exit_tp ${EXIT_SERVER_FLAGS---load-format dummy --max-model-len 1024}"
  dummy llama3.2-1b "$exit_model"
  complete() {  # complete [MAX_S]: one 8-token completion through the OpenAI API; true if it came back
    curl -sf --max-time "${1:-60}" "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"$(basename "$exit_model")\", \"prompt\": \"t5 t6 t7 t8\", \"max_tokens\": 8, \"ignore_eos\": true}" \
      | grep -q '"choices"'
  }
  worker_pids() {  # worker_pids [RANK]: the server's live worker processes (all ranks, or one)
    python - "$SERVER_PID" "${1:-}" << 'PY'
import sys

import psutil

root, rank, pids = int(sys.argv[1]), sys.argv[2], []
for process in psutil.Process(root).children(recursive=True):
    try:
        command, alive = process.cmdline(), process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        continue
    if alive and "zllm.workers.process" in command and (not rank or command[command.index("--rank") + 1] == rank):
        pids.append(process.pid)
print(" ".join(map(str, sorted(pids))))
PY
  }
  exit_phase() {  # exit_phase NAME KILL_RANK_1 (0 or 1)
    local name=$1 kill_one=$2 started rc
    serve_start "$name" 240 --model "$exit_model" "${exit_flags[@]}" || return
    complete; verdict "$name: a request" $?
    local before
    before=$(worker_pids)
    echo "   workers: $before"
    if [[ $kill_one == 1 ]]; then
      local victim
      victim=$(worker_pids 1)
      echo "   kill -9 of rank 1's worker (pid $victim)"
      kill -KILL "$victim"
      started=$(date +%s)
      rc=124
      while (( $(date +%s) - started < 240 && $(time_left) > 90 )); do
        local now
        now=$(worker_pids)
        if [[ -n "$now" && "$now" != "$before" && $(wc -w <<< "$now") -eq $exit_tp ]] && complete 30; then
          echo "   engine restarted: a request served $(( $(date +%s) - started )) s after the kill, workers now: $now"
          rc=0
          break
        fi
        sleep 2
      done
      verdict "$name: the engine restarted after kill -9 of a worker" $rc
      grep -E "recovered in|restarting the" "$out/server-$name.err" | tail -2 | sed 's/^/    /'
      complete; verdict "$name: a request after the restart" $?
    fi
    serve_stop 60
    rc=$?
    echo "   exit code $rc"
    verdict "$name: vllm-launch exited 0 after SIGTERM" $rc
    local warnings  # PyTorch's: "Warning: WARNING: destroy_process_group() was not called before program exit, ..."
    warnings=$(grep -c "destroy_process_group() was not called" "$out/server-$name.err")
    grep "destroy_process_group" "$out/server-$name.err" | head -3 | sed 's/^/    /'  # ours too ("... failed"), if any
    verdict "$name: no destroy_process_group warning on stderr ($warnings lines)" $(( warnings > 0 ))
    local left
    left=$(grep -cE "left the (nccl|gloo) group" "$out/server-$name.err")
    verdict "$name: ranks that left their group at the last stop: $left (expected $exit_tp)" $(( left < exit_tp ))
    gpus_free 30
    verdict "$name: no process left on a GPU" $?
  }
  exit_phase exit-sigterm 0
  exit_phase exit-kill9 1
  ;;
ar70b)
  dummy llama3-70b "$m70b"
  w2_70b() {  # w2_70b NAME FLAGS...: W2 at tp 4 on the 70B shape
    bounded "$1" 200 python benchmarks/latency.py --model "$m70b" --load-format dummy --input-len 128 --output-len 256 \
      --iters 2 --tp 4 --max-model-len 1024 "${@:2}"
    gpus_free 30 || { echo "FAIL $1: GPU memory still held after it exited"; status=1; }
  }
  runs=" ${AR70B_RUNS:-nccl symm shard itl} "  # a subset, in this order
  [[ $runs == *" nccl "* ]] && w2_70b w2-70b-nccl
  [[ $runs == *" symm "* ]] && w2_70b w2-70b-symm --custom-all-reduce-max-size "${AR_MAX:-1MiB}"
  # One rank's weights as a whole model on GPU 0: the tp 4 step less its all-reduces and peers.
  m70b_shard=${DRY_MODEL:-/tmp/zllm-llama3-70b-shard4}
  if [[ $runs == *" shard "* ]]; then
    dummy llama3-70b-shard4 "$m70b_shard"
    CUDA_VISIBLE_DEVICES=0 bounded w2-70b-shard4-tp1 150 python benchmarks/latency.py --model "$m70b_shard" \
      --load-format dummy --input-len 128 --output-len 256 --iters 2 --max-model-len 1024
  fi
  [[ $runs == *" itl "* ]] && bounded served-itl-70b 260 python benchmarks/served_itl.py --model "$m70b" --requests 3 --modes offline,http --trace \
    -- --load-format dummy --tp 4 --max-model-len 1024 --no-enable-prefix-caching ${ITL_FLAGS:-}
  [[ -f "$out/served-itl-70b.log" ]] && python - "$out/served-itl-70b.log" << 'PY'
import json, sys

text = open(sys.argv[1]).read()
start = 0 if text.startswith("{\n") else text.rfind("\n{\n") + 1
if start > 0 or text.startswith("{\n"):
    report = json.loads(text[start:])
    for mode in ("offline", "http"):
        row = report.get(mode, {})
        print(mode, {k: v for k, v in row.items() if not isinstance(v, (dict, list))})
    print("config differences:", report.get("config_differences"))
    print("http - offline (us):", report.get("http_minus_offline_us"))
PY
  ;;
tails70b)
  need_client_files || exit 1
  dummy llama3-70b "$m70b"
  results="$out/tails70b"
  rm -rf "$results"
  read -ra tail_flags <<< "${TAIL_FLAGS:-}"
  for budget in ${TAIL_BUDGETS:-2048 512}; do
    mkdir -p "$results/b$budget"
    fits "tails-b$budget" 200 || break
    # Every step traced: what the inter-token tails are made of (step periods by the prompt tokens carried).
    export ZLLM_STEP_TRACE="$out/trace-b$budget"
    serve_start "t70b-b$budget" 200 --model "$m70b" --load-format dummy --max-model-len 1024 --tp 4 \
      --no-enable-prefix-caching --max-num-batched-tokens "$budget" "${tail_flags[@]}"
    started=$?
    unset ZLLM_STEP_TRACE  # the server has it; the client and the summaries must not
    (( started == 0 )) || continue
    vllm_client "t70b-b$budget-warm" 90 "${client70b[@]}" --num-prompts 32 --request-rate inf --random-input-len 256 \
      --random-output-len 64 --seed 1000
    for spec in ${TAIL_RATES:-4:200 12:480}; do
      rate=${spec%%:*} n=${spec##*:}
      fits "t70b-b$budget-poisson$rate" $(( n / rate + 25 )) || continue
      vllm_client "t70b-b$budget-poisson$rate" $(( 2 * (n / rate + 20) + 60 )) "${client70b[@]}" --num-prompts "$n" \
        --request-rate "$rate" --random-input-len 256 --random-output-len 256 --seed "$rate" --save-result \
        --result-dir "$results/b$budget" --result-filename "poisson$rate.json" --metadata "label=budget-$budget"
    done
    serve_stop 90
    verdict "server t70b-b$budget stop" $?
    timeout 60 python benchmarks/step_trace_summary.py "$out/trace-b$budget" --by-prefill --bucket 128 \
      | grep prefill_tokens | tee "$out/steps-b$budget.jsonl"
    gpus_free 30 || { echo "FAIL: GPU memory still held after the 70B server exited"; status=1; }
  done
  for table in "$results"/b*; do
    echo "### --max-num-batched-tokens ${table##*/b}"
    timeout 60 python benchmarks/plot_sweep.py "$table"
  done | tee "$dest/tails70b.md"
  ;;
dpserve)
  need_client_files || exit 1
  dummy llama3-8b "$m8b"
  if [[ -n "${DP_TRACES:-}" ]]; then  # the dp 2 traces of 2026-11-27 (dp 2 = one engine with half the prompts)
    traced dp2 --dp 2
    W1_PROMPTS=$(( ${W1_PROMPTS:-1000} / 2 )) traced dp1-half --dp 1
    CUDA_VISIBLE_DEVICES=2,3 traced dp2-gpus23 --dp 2
  fi
  results="$out/dpserve"
  mkdir -p "$results"
  rate=${DP_RATE:-120} n=${DP_PROMPTS:-2400}
  client8b=(--model "$(basename "$m8b")" --tokenizer "$m8b" --ignore-eos)
  for count in ${DP_API_COUNTS:-1 4}; do  # frontend processes (--api-server-count) in front of the 4 engines
    name=dp4-api$count
    fits "$name" $(( 100 + n / rate )) || break
    serve_start "$name" 150 --model "$m8b" --load-format dummy --max-model-len 1024 --dp 4 \
      --api-server-count "$count" || continue
    vllm_client "$name-warm" 60 "${client8b[@]}" --num-prompts 64 --request-rate inf --random-input-len 256 \
      --random-output-len 32 --seed 1000
    # Which process bounds the served run: every process's CPU share each second (frontends,
    # cores, workers, the client), and a py-spy profile of one frontend in the middle of the load.
    python benchmarks/proc_cpu.py --root "$SERVER_PID" --seconds $(( 3 * n / rate + 90 )) > "$out/$name-cpu.jsonl" &
    sampler=$!
    frontend=$SERVER_PID
    if (( count > 1 )); then
      frontend=$(pgrep -f -P "$SERVER_PID" zllm.launch.api_server_process | head -1)
    fi
    spy=$(command -v py-spy || echo /tmp/zllm-site/bin/py-spy)
    if [[ -x "$spy" && -n "$frontend" ]]; then
      (sleep $(( n / rate / 3 )) && timeout 30 "$spy" record --nonblocking -r 100 -d 10 -f raw -p "$frontend" \
        -o "$out/$name-frontend.pyspy.txt" > "$out/$name-pyspy.log" 2>&1) &
    fi
    vllm_client "$name-poisson$rate" $(( 3 * n / rate + 90 )) "${client8b[@]}" --num-prompts "$n" --request-rate "$rate" \
      --random-input-len 256 --random-output-len 256 --seed "$rate" --save-result --result-dir "$results" \
      --result-filename "$name-poisson$rate.json" --metadata "label=api-servers-$count"
    kill -TERM "$sampler" 2> /dev/null
    wait "$sampler"
    tail -1 "$out/$name-cpu.jsonl"
    [[ -f "$out/$name-frontend.pyspy.txt" ]] && python benchmarks/proc_cpu.py --top-stacks "$out/$name-frontend.pyspy.txt"
    serve_stop 90
    verdict "server $name stop" $?
    gpus_free 30 || { echo "FAIL: GPU memory still held after the $name server exited"; status=1; }
  done
  timeout 60 python benchmarks/plot_sweep.py "$results" | tee "$dest/dpserve.md"
  if fits served-itl-8b 200; then
    CUDA_VISIBLE_DEVICES=0 bounded served-itl-8b 200 python benchmarks/served_itl.py --model "$m8b" --requests 3 \
      --modes offline,http --trace -- --load-format dummy --max-model-len 1024 --no-enable-prefix-caching
  fi
  ;;
arnorm)
  export ZLLM_DEBUG_HANG_S="${ZLLM_DEBUG_HANG_S:-120}"
  bounded arnorm-tests 300 python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_allreduce_norm_gpu.py
  tail -3 "$out/arnorm-tests.log"
  dummy llama3-70b "$m70b"
  for on in 0 1; do
    ZLLM_ALLREDUCE_NORM=$on bounded "w2-70b-arnorm$on" 200 python benchmarks/latency.py --model "$m70b" \
      --load-format dummy --input-len 128 --output-len 256 --iters 2 --tp 4 --max-model-len 1024 \
      --custom-all-reduce-max-size "${AR_MAX:-1MiB}"
    gpus_free 30 || { echo "FAIL w2-70b-arnorm$on: GPU memory still held after it exited"; status=1; }
  done
  ;;
lamport)
  export ZLLM_DEBUG_HANG_S="${ZLLM_DEBUG_HANG_S:-120}"
  steps=" ${LAMPORT_STEPS:-tests bench w2} "
  if [[ $steps == *" tests "* ]]; then
    bounded lamport-tests 300 python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_lamport_all_reduce_gpu.py \
      tests/gpu/test_allreduce_norm_gpu.py -k "lamport"
    tail -3 "$out/lamport-tests.log"
  fi
  if [[ $steps == *" tpfiles "* ]]; then  # the multi-GPU files under the defaults (Lamport at tp 2 and 4 since 2026-11-28)
    bounded lamport-tpfiles "${TPFILES_LIMIT_S:-560}" python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_tensor_parallel_gpu.py \
      tests/gpu/test_ray_backend_gpu.py tests/gpu/test_pooling_gpu.py -k "tensor_parallel or tp2 or tp4 or symmetric or ray"
    tail -3 "$out/lamport-tpfiles.log"
  fi
  if [[ $steps == *" bench "* ]]; then
    for tp in 2 4; do
      bounded "all-reduce-tp$tp" 90 python benchmarks/all_reduce.py --tp "$tp"
    done
  fi
  if [[ $steps == *" w2 "* ]]; then
    dummy llama3-70b "$m70b"
    IFS=';' read -ra sets <<< "${LAMPORT_SETS:-oneshot:ZLLM_ALLREDUCE_LAMPORT=0;lamport:ZLLM_ALLREDUCE_LAMPORT=1;lamportnorm:ZLLM_ALLREDUCE_LAMPORT=1 ZLLM_ALLREDUCE_NORM=1}"
    for set in "${sets[@]}"; do
      label=${set%%:*} assignments=""
      [[ $set == *:* ]] && assignments=${set#*:}
      fits "w2-70b-$label" 100 || continue
      echo "{\"lamport_w2\": \"$label\", \"env\": \"$assignments\"}" | tee -a "$jsonl"
      bounded "w2-70b-$label" 200 env $assignments python benchmarks/latency.py --model "$m70b" \
        --load-format dummy --input-len 128 --output-len 256 --iters 2 --tp 4 --max-model-len 1024 \
        --custom-all-reduce-max-size "${AR_MAX:-1MiB}"
      gpus_free 30 || { echo "FAIL w2-70b-$label: GPU memory still held after it exited"; status=1; }
    done
  fi
  ;;
w2ab70)
  export ZLLM_DEBUG_HANG_S="${ZLLM_DEBUG_HANG_S:-120}"
  W2AB_TESTS=${W2AB_TESTS-tests/gpu/test_pdl_gpu.py tests/gpu/test_fused_act_gemv_gpu.py tests/gpu/test_fused_rope_gemv_gpu.py}
  if [[ -n "$W2AB_TESTS" ]]; then
    CUDA_VISIBLE_DEVICES=0 bounded w2ab-tests 200 python -m pytest -q -p no:cacheprovider -rs $W2AB_TESTS
    tail -3 "$out/w2ab-tests.log"
  fi
  dummy llama3-70b "$m70b"
  IFS=';' read -ra sets <<< "${W2AB_SETS:-unfused:ZLLM_FUSED_ACT_GEMV=0 ZLLM_FUSED_ROPE_GEMV=0;base;attn:ZLLM_PDL_ATTENTION=1;arnorm:ZLLM_ALLREDUCE_NORM=1;all:ZLLM_PDL_ATTENTION=1 ZLLM_ALLREDUCE_NORM=1}"
  for round in $(seq "${W2AB_ROUNDS:-1}"); do
    for set in "${sets[@]}"; do
      label=${set%%:*} assignments=""
      [[ $set == *:* ]] && assignments=${set#*:}
      fits "w2-70b-$label-$round" 100 || continue
      echo "{\"w2ab70\": \"$label\", \"round\": $round, \"env\": \"$assignments\"}" | tee -a "$jsonl"
      bounded "w2-70b-$label-$round" 200 env $assignments python benchmarks/latency.py --model "$m70b" \
        --load-format dummy --input-len 128 --output-len 256 --iters 2 --tp 4 --max-model-len 1024 \
        --custom-all-reduce-max-size "${AR_MAX:-1MiB}"
      gpus_free 30 || { echo "FAIL w2-70b-$label-$round: GPU memory still held after it exited"; status=1; }
    done
  done
  ;;
symm4)
  export ZLLM_DEBUG_HANG_S="${ZLLM_DEBUG_HANG_S:-120}"
  bounded symm4-tests 480 python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_tensor_parallel_gpu.py \
    -k "symmetric or fp32_greedy"
  tail -3 "$out/symm4-tests.log"
  cat "$dest/gpu_results.jsonl" 2> /dev/null  # the tests' record() lines: shares of identical tokens
  ;;
serve70b)
  need_client_files || exit 1
  dummy llama3-70b "$m70b"
  results="$out/serve70b"
  rm -rf "$results"
  mkdir -p "$results"
  read -ra flags70b <<< "${SERVE70B_FLAGS---no-enable-prefix-caching}"
  client=("${client70b[@]}")
  keep_for_w2=130  # W2 after the server: a 70B start (~90 s) and 2 x 2 timed generations
  if serve_start s70b 300 --model "$m70b" --load-format dummy --max-model-len 1024 --tp 4 "${flags70b[@]}"; then
    vllm_client s70b-warm 120 "${client[@]}" --num-prompts 32 --request-rate inf --random-input-len 256 \
      --random-output-len 256 --seed 1000
    for i in 1 2 3 4 5 6; do  # seeds apart from the Poisson runs': no prompt repeats across runs
      fits "s70b-batch1-$i" 15 $keep_for_w2 || break
      vllm_client "s70b-batch1-$i" 90 "${client[@]}" --num-prompts 1 --request-rate inf --random-input-len 128 \
        --random-output-len 256 --seed $(( 100 + i )) --save-result --result-dir "$results" \
        --result-filename "batch1_$i.json" --metadata label=batch-1
    done
    for spec in 4:200 12:480; do
      rate=${spec%%:*} n=${spec##*:}
      fits "s70b-poisson$rate" $(( n / rate + 20 )) $keep_for_w2 || continue
      vllm_client "s70b-poisson$rate" $(( 2 * (n / rate + 20) + 60 )) "${client[@]}" --num-prompts "$n" --request-rate "$rate" \
        --random-input-len 256 --random-output-len 256 --seed "$rate" --save-result --result-dir "$results" \
        --result-filename "poisson$rate.json" --metadata label=poisson
    done
    serve_stop 90
    verdict "server s70b stop" $?
    gpus_free 30 || { echo "FAIL: GPU memory still held after the 70B server exited"; status=1; }
  fi
  timeout 60 python benchmarks/plot_sweep.py "$results" | tee "$dest/serve70b.md"
  bounded w2-70b-tp4 240 python benchmarks/latency.py --model "$m70b" --load-format dummy --input-len 128 --output-len 256 \
    --iters 2 --tp 4 --max-model-len 1024
  ;;
esac
pack_results "$dest" "4gpu-$part"
echo "== $part: $( ((status == 0)) && echo 'all passed' || echo 'SOMETHING FAILED OR WAS SKIPPED (see above)'), $(( $(date +%s) - t0 )) s"
exit $status
