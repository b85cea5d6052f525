#!/usr/bin/env bash
# The whole single-GPU test suite in one pytest process, longer than one device call (issue 40,
# part 1: ~1,000 s on one H200 on 2026-11-28, against a 600 s call). The first call starts it in a
# process session of its own, which outlives the call on a warm machine; each later call, made
# before the machine goes idle, waits for it and reports. Run from the repository root:
#   bash benchmarks/gpu/run_suite.sh start [WAIT_S]   # start, then wait up to WAIT_S (default 540)
#   bash benchmarks/gpu/run_suite.sh wait [WAIT_S]    # wait up to WAIT_S for it to end
# Every call prints the tests done so far, each failure's name as it happens (-v), and at the end
# pytest's summary and slowest tests; the gzipped log goes to $OUT. Kernels: whatever env says
# (ZLLM_KERNELS=prebuilt with ZLLM_CSRC_BUILD for cubins carried in). The run stops itself after
# SUITE_S (default 1800) and dumps every thread's stack for a test past SUITE_HANG_S (200).
# SUITE_FROM=tests/gpu/test_pdl_gpu.py runs that file and every one after it (pytest's order), in
# one process: the rest of a suite whose machine was taken back part way (the log names the file
# it was in). SUITE_LAST="a.py b.py" moves those files to the end (the pooling tests, when their
# all-MiniLM directory comes with a later call).
set -uo pipefail
log=${SUITE_LOG:-/tmp/zllm-suite.log}
mode=${1:-wait}
wait_s=${2:-540}
t0=$(date +%s)

start() {
  if pgrep -f "pytest .*-p no:cacheprovider .*tests/gpu" > /dev/null; then
    echo "a suite is already running"
    return
  fi
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  local targets
  targets=$(suite_files) || return 1
  echo "pytest targets: $targets" | cut -c1-400
  # -v: each test's outcome as it ends, so a call that ends before the suite does still names
  # the failures so far.
  setsid nohup bash -c 'timeout -k 60 "$1" python -m pytest -v --tb=short -p no:cacheprovider -rfEs \
    -o faulthandler_timeout="$2" --durations=40 ${4} > "$3" 2>&1; echo suite-rc=$? >> "$3"' \
    _ "${SUITE_S:-1800}" "${SUITE_HANG_S:-200}" "$log" "$targets" > /dev/null 2>&1 < /dev/null &
  echo "started at $(date -u +%H:%M:%S), log $log"
}

# The test files to run, in pytest's order (sorted names), from SUITE_FROM on, SUITE_LAST last;
# plain tests/gpu when neither is set.
suite_files() {
  if [ -z "${SUITE_FROM:-}" ] && [ -z "${SUITE_LAST:-}" ]; then
    echo tests/gpu
    return
  fi
  local files f last=" ${SUITE_LAST:-} " picked="" tail=""
  files=$(ls tests/gpu/test_*.py | LC_ALL=C sort)
  if [ -n "${SUITE_FROM:-}" ] && ! grep -qxF "$SUITE_FROM" <<< "$files"; then
    echo "SUITE_FROM=$SUITE_FROM is not a file of tests/gpu" >&2
    return 1
  fi
  local on=${SUITE_FROM:+0}
  for f in $files; do
    [ "$f" = "${SUITE_FROM:-}" ] && on=1
    [ "${on:-1}" = 1 ] || continue
    if [[ $last == *" $f "* ]]; then tail="$tail $f"; else picked="$picked $f"; fi
  done
  echo $picked $tail
}

report() {
  local done failed
  # -v ends each outcome with its progress suffix (at a line's start after a faulthandler dump)
  done=$(grep -cE "(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)( \(.*\))? +\[ *[0-9]+%\]$" "$log")
  failed=$(grep -cE "(FAILED|ERROR) +\[ *[0-9]+%\]$" "$log")
  echo "outcome lines so far: $done, failed: $failed, elapsed here: $(( $(date +%s) - t0 )) s"
  grep -E "(FAILED|ERROR) +\[ *[0-9]+%\]$" "$log" | head -60
  if grep -q '^suite-rc=' "$log"; then
    sed -n '/slowest .* durations/,/short test summary/p' "$log" | head -45
    grep -E "^(FAILED|ERROR) " "$log" | head -60
    tail -2 "$log"
  else
    echo "still running: $(tail -1 "$log" | cut -c1-160)"
  fi
  if [ -n "${OUT:-}" ]; then gzip -c "$log" > "$OUT/suite.log.gz"; fi
}

case $mode in
  start) start; sleep 5 ;;
  wait) ;;
  *) echo "usage: $0 start|wait [WAIT_S]" >&2; exit 2 ;;
esac
[ -f "$log" ] || { echo "no suite log at $log: start it first"; exit 1; }
deadline=$(( t0 + wait_s ))
while ! grep -q '^suite-rc=' "$log" && (( $(date +%s) < deadline )); do sleep 10; done
report
