# Sourced by the GPU run books (run_perf.sh's sweep, run_4gpu.sh): steps bounded by `timeout` under
# one deadline for the whole call, a PASS/FAIL/TIMEOUT/SKIPPED line for each, a served vllm-launch
# that is always stopped, vLLM's own load client, and the results packed into the few files a
# device call brings back (at most 8 from $OUT, 16 MiB each).
# The caller sets: out (working folder for logs and results), jsonl (JSON lines file), deadline
# (epoch seconds by which the call must be over; steps are cut to what is left of it, less a
# margin for what follows).
# Sets: status (1 once anything failed, timed out or was skipped).
status=0
SERVER_PID=""
SDIST=.sdist/vllm-0.6.3.post1.tar.gz  # benchmarks/vllm_benchmark_serving.py --download-only puts it there
PORT=${SERVE_PORT:-8000}

time_left() { echo $(( deadline - $(date +%s) )); }

verdict() {  # verdict NAME RC [LOG]: the PASS/FAIL/TIMEOUT line (and the log's tail on failure)
  local name=$1 rc=$2 log=${3:-}
  if [[ $rc -eq 0 ]]; then echo "PASS $name"
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then echo "TIMEOUT $name${log:+ (log: $log)}"; status=1
  else echo "FAIL $name (exit $rc)${log:+ (log: $log)}"; status=1; fi
  if [[ $rc -ne 0 && -n "$log" && -f "$log" ]]; then tail -8 "$log" | sed 's/^/    /'; fi
}

bounded() {  # bounded NAME LIMIT_S COMMAND...: COMMAND (an executable) under timeout; log in $out/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$(( $(time_left) - ${MARGIN_S:-20} ))
  (( left < limit )) && limit=$left
  if (( limit < 15 )); then echo "SKIPPED $name (no time left in this call)"; status=1; return 125; fi
  echo "== $name (limit ${limit}s, $(time_left)s left): $*"
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -E '^\{' "$out/$name.log" | tee -a "$jsonl"
  verdict "$name" $rc "$out/$name.log"
  return $rc
}

fits() {  # fits NAME SECONDS [RESERVE_S]: true if SECONDS (+ RESERVE_S kept for later steps) still fit
  local need=$(( $2 + ${3:-0} + ${MARGIN_S:-20} ))
  if (( $(time_left) < need )); then
    echo "SKIPPED $1 (needs ~$2 s$( (( ${3:-0} > 0 )) && echo " + $3 s kept for later steps"), $(time_left) s left)"
    status=1
    return 1
  fi
}

serve_start() {  # serve_start NAME LIMIT_S ARGS...: vllm-launch ARGS on $PORT (8000) in its own session; waits for /health
  local name=$1 limit=$2
  shift 2
  echo "== server $name: vllm-launch $*"
  local started=$(date +%s)
  setsid python -m zllm.launch.cli --port "$PORT" "$@" > "$out/server-$name.out" 2> "$out/server-$name.err" &
  SERVER_PID=$!
  SERVER_NAME=$name
  local left=$(( $(time_left) - ${MARGIN_S:-20} ))
  (( left < limit )) && limit=$left
  while (( $(date +%s) - started < limit )); do
    if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then
      echo "   ready in $(( $(date +%s) - started )) s (pid $SERVER_PID)"
      return 0
    fi
    if ! kill -0 "$SERVER_PID" 2> /dev/null; then
      wait "$SERVER_PID"
      verdict "server-$name start" $? "$out/server-$name.err"
      SERVER_PID=""
      return 1
    fi
    sleep 1
  done
  verdict "server-$name start" 124 "$out/server-$name.err"
  serve_kill
  return 1
}

serve_stop() {  # serve_stop [LIMIT_S]: SIGTERM the server, wait for it; returns its exit code (124: killed after LIMIT_S)
  local limit=${1:-60}
  [[ -n "$SERVER_PID" ]] || return 0
  local pid=$SERVER_PID started=$(date +%s)
  kill -TERM "$pid" 2> /dev/null
  while kill -0 "$pid" 2> /dev/null && (( $(date +%s) - started < limit )); do sleep 0.5; done
  if kill -0 "$pid" 2> /dev/null; then
    echo "   server $SERVER_NAME still running ${limit} s after SIGTERM: killed"
    serve_kill
    return 124
  fi
  wait "$pid"
  local rc=$?
  echo "   server $SERVER_NAME exited $rc, $(( $(date +%s) - started )) s after SIGTERM"
  SERVER_PID=""
  return $rc
}

serve_kill() {  # SIGKILL the server's whole session (its engine cores and workers included)
  [[ -n "$SERVER_PID" ]] || return 0
  if [[ "$(ps -o pgid= -p "$SERVER_PID" 2> /dev/null | tr -d ' ')" == "$SERVER_PID" ]]; then
    kill -KILL -- "-$SERVER_PID" 2> /dev/null
  else
    kill -KILL "$SERVER_PID" 2> /dev/null
  fi
  wait "$SERVER_PID" 2> /dev/null
  SERVER_PID=""
}
trap serve_kill EXIT

vllm_client() {  # vllm_client NAME LIMIT_S ARGS...: vLLM's benchmark_serving.py against the server on $PORT
  bounded "$1" "$2" python benchmarks/vllm_benchmark_serving.py --sdist "$SDIST" --base-url "http://127.0.0.1:$PORT" \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 "${@:3}"
  local rc=$?
  grep -E "^(Successful requests|Request throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL)" "$out/$1.log" 2> /dev/null \
    | sed 's/^/    /'
  return $rc
}

gpus_free() {  # gpus_free [WAIT_S]: true once no process holds a GPU (waits up to WAIT_S); prints what is left
  local wait_s=${1:-20} started=$(date +%s) apps
  while :; do
    apps=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1)
    [[ -z "$apps" ]] && return 0
    (( $(date +%s) - started >= wait_s )) && break
    sleep 1
  done
  echo "   GPU processes left: $apps"
  return 1
}

need_client_files() {  # vLLM's client: the carried sdist and the modules it imports
  if [[ ! -f "$SDIST" ]]; then
    echo "FAIL: no $SDIST (here: python benchmarks/vllm_benchmark_serving.py --download-only; carry .sdist)"
    return 1
  fi
  python -c 'import aiohttp, numpy, tqdm, transformers, huggingface_hub, PIL' 2>&1 \
    || { echo "FAIL: vLLM's client cannot import its modules (carry .whl: aiohttp and its dependencies)"; return 1; }
}

pack_results() {  # pack_results DEST NAME: $out as DEST/NAME-logs.tar.gz (the client's JSONs without their texts)
  local dest=$1 name=$2
  [[ "$(realpath "$dest")" != "$(realpath "$out")" ]] || return 0
  # generated_texts: the dummy models' words, most of a result file's size and of no use here
  find "$out" -name '*.json' -print0 | xargs -0 -r python -c '
import json, sys
for path in sys.argv[1:]:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and data.pop("generated_texts", None) is not None:
        with open(path, "w") as f:
            json.dump(data, f)
'
  tar -czf "$dest/$name-logs.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" \
    && echo "   logs and results: $dest/$name-logs.tar.gz ($(du -h "$dest/$name-logs.tar.gz" | cut -f1))"
}
