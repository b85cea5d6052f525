#!/usr/bin/env bash
# On a 2-GPU kind (nvidia-h100-x2; it may come as 2 x H200: the first lines say which): issue 37's
# Ray backend on one node. Usage: bash benchmarks/gpu/run_ray.sh stage|check|w2, three calls made
# back to back on one warm machine (files under /tmp survive while it is warm).
#
#   stage: carry .rw1: keeps the first half of the ray wheel in /tmp; with .cbr (sm_90 cubins built
#          here, attention_window_kernels left out for room) carried too, no csrc build later.
#   check: carry .rw2 and .whl: joins the wheel, installs it with ray's missing dependencies into
#          /tmp/ray-site, builds csrc, then correctness: tests/gpu/test_ray_backend_gpu.py on the
#          gqa-d128 shape (Ray tp 2 = mp tp 2 = HF in fp32; = mp with the symmetric all-reduce in
#          bf16), and benchmarks/tp_agreement.py on the Llama-3.2-1B shape (dummy fp32, 32 prompts
#          of 64 in / 128 out): Ray's tp 2 against mp's tp 2, every request identical.
#          Estimate (not measured): install 20 s, build <= 300 s on a fresh machine, tests ~150 s,
#          agreement ~90 s.
#   w2:    carry .whl: W2 (benchmarks/latency.py, Llama-3-8B shape, dummy bf16, tp 2, batch 1,
#          128 in / 256 out, 3 iterations) with mp, with ray, with mp again (the spread of mp's two
#          runs is the noise), then the ray/mp ratio: PASS within 3 % of the mean of mp's runs.
#          Estimate (not measured): three engine starts of ~45 s plus ~10 s of decoding each.
#
# Prep on the CPU machine, in the repository root (the GPU machine has no ray and no network;
# Python 3.12 there; a call carries at most 64 MiB, and the ray 2.60.0 cp312 wheel is 79 MB):
#   1. ray's own dependencies (its METADATA: click, filelock, jsonschema, msgpack, packaging,
#      protobuf, pyyaml, requests) and theirs, into .whl/ (git-ignored) beside pyzmq and msgspec.
#      benchmarks/gpu/env.sh installs all of .whl ahead of the image's packages, so only those the
#      image may lack: filelock, packaging and pyyaml come with torch and transformers there.
#        ../shared/gpu/wheels.sh click jsonschema jsonschema-specifications referencing rpds-py \
#          attrs 'msgpack<2' protobuf requests certifi charset-normalizer idna urllib3
#      (`check` stops with the import error if ray still misses one: add it here.)
#   2. the ray wheel in two halves (.rw1/, .rw2/: git-ignored through .git/info/exclude):
#        pip download --no-deps --python-version 3.12 --only-binary=:all: \
#          --platform manylinux2014_x86_64 ray==2.60.0 -d /work/main/.rayw
#        W=/work/main/.rayw/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl; half=$(( $(stat -c %s $W) / 2 ))
#        mkdir -p .rw1 .rw2 && head -c $half $W > .rw1/part && tail -c +$(( half + 1 )) $W > .rw2/part
#      (/work/main/.rayw/rw1.part and rw2.part are these two halves, made that way.)
#   3. the device calls: run(kind=nvidia-h100-x2, carry=[".rw1"], "bash benchmarks/gpu/run_ray.sh stage"),
#      at once run(carry=[".rw2", ".whl"], "bash benchmarks/gpu/run_ray.sh check"),
#      then run(carry=[".whl"], "bash benchmarks/gpu/run_ray.sh w2").
# Into $OUT (default /tmp/zllm-ray): ray-PART.log (the whole output), ray.jsonl (JSON lines),
# gpu_results.jsonl (the tests' figures). Exits 1 if anything failed.
set -uo pipefail
t0=$(date +%s)
cd "$(dirname "$0")/../.."
part="${1:-}"
case "$part" in stage | check | w2) ;; *) echo "usage: $0 stage|check|w2"; exit 2 ;; esac
WHEEL_NAME=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl  # pip needs a wheel's own file name
WHEEL_SHA256=b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a
SITE=/tmp/ray-site
export OUT="${OUT:-/tmp/zllm-ray}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/ray-$part.log") 2>&1
jsonl="$OUT/ray.jsonl"
status=0

if [[ $part == stage ]]; then
  if [[ -d .cbr/sm_90 ]]; then  # optional: cubins built on the CPU machine (scripts/build_csrc.sh), no build here
    mkdir -p /tmp/zllm-csrc-build && cp -r .cbr/sm_90 /tmp/zllm-csrc-build/ && touch /tmp/zllm-csrc-build/sm_90/*
  fi
  cp .rw1/part /tmp/rw1.part && ls -la /tmp/rw1.part && exit 0
  echo "FAIL stage: carry .rw1 (this script's header)"; exit 1
fi

source benchmarks/gpu/env.sh  # the repository and .whl's packages (pyzmq, msgspec, ...) on PYTHONPATH
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1

if [[ $part == check ]]; then
  if [[ ! -f /tmp/rw1.part || ! -f .rw2/part ]]; then
    echo "FAIL check: needs /tmp/rw1.part (the stage call, just before, on this machine) and .rw2 carried"; exit 1
  fi
  cat /tmp/rw1.part .rw2/part > "/tmp/$WHEEL_NAME"
  echo "$WHEEL_SHA256  /tmp/$WHEEL_NAME" | sha256sum -c - || { echo "FAIL check: the joined wheel is not ray 2.60.0's"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "/tmp/$WHEEL_NAME" || exit 1
fi
export PYTHONPATH="$PYTHONPATH:$SITE" RAY_USAGE_STATS_ENABLED=0
python3 -c "import ray; print('ray', ray.__version__)" \
  || { echo "FAIL: ray does not import (above: a dependency missing from .whl, or no stage + check yet)"; exit 1; }

export ZLLM_CSRC_BUILD=/tmp/zllm-csrc-build  # fresh: a carried build dir has this machine's cmake cache
[[ -n "${SKIP_CSRC_BUILD:-}" || -f $ZLLM_CSRC_BUILD/sm_90/attention_kernels.cubin ]] \
  || timeout 300 bash scripts/build_csrc.sh "$ZLLM_CSRC_BUILD" -DZLLM_CUBIN_ARCHS=90 > "$OUT/build.log" 2>&1 \
  || { echo "csrc build failed (the loader falls back to what was built, or NVRTC):"; tail -15 "$OUT/build.log"; }
[[ -f $ZLLM_CSRC_BUILD/sm_90/attention_kernels.cubin ]] && export ZLLM_KERNELS=prebuilt
echo "csrc build: done $(( $(date +%s) - t0 )) s after the start"

step() {  # step NAME LIMIT_S COMMAND...: PASS/FAIL/TIMEOUT, JSON lines to ray.jsonl
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout -k 10 "$limit" "$@" > "/tmp/ray-$name.log" 2>&1
  local rc=$?
  grep -E '^\{' "/tmp/ray-$name.log" | tee -a "$jsonl"
  if [[ $rc -eq 0 ]]; then echo "PASS $name"; else echo "FAIL $name (exit $rc)"; tail -25 "/tmp/ray-$name.log"; status=1; fi
  return $rc
}

if [[ $part == check ]]; then
  step gpu-tests 240 python -m pytest -x -q tests/gpu/test_ray_backend_gpu.py -k gqa-d128
  grep -E "passed|failed|skipped" /tmp/ray-gpu-tests.log | tail -2
  python benchmarks/dummy_model.py llama3.2-1b /tmp/zllm-llama3.2-1b > /dev/null
  step agreement 200 python benchmarks/tp_agreement.py --model /tmp/zllm-llama3.2-1b --load-format dummy \
    --dtype float32 --tp 2 --reference-tp 2 --distributed-executor-backend ray --require-equal
fi

if [[ $part == w2 ]]; then
  model=/tmp/zllm-llama3-8b
  python benchmarks/dummy_model.py llama3-8b "$model" > /dev/null
  for backend in mp ray mp; do
    step "w2-$backend" 170 python benchmarks/latency.py --model "$model" --load-format dummy --input-len 128 \
      --output-len 256 --iters 3 --max-model-len 1024 --tp 2 --distributed-executor-backend "$backend"
  done
  python3 - "$jsonl" <<'EOF' || status=1
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1]) if '"decode_ms_per_token"' in line]
mp = [r["decode_ms_per_token"] for r in runs if r.get("distributed_executor_backend") == "mp"][-2:]
ray = [r["decode_ms_per_token"] for r in runs if r.get("distributed_executor_backend") == "ray"][-1:]
if len(mp) < 2 or not ray:
    sys.exit(f"FAIL w2: runs missing (mp {mp}, ray {ray})")
ratio = ray[0] / statistics.mean(mp)
print(json.dumps({"benchmark": "w2_ray_vs_mp", "mp_ms_per_token": mp, "ray_ms_per_token": ray[0],
                  "ratio": round(ratio, 4), "mp_spread": round(abs(mp[0] - mp[1]) / statistics.mean(mp), 4)}))
print(("PASS" if abs(ratio - 1) <= 0.03 else "FAIL") + f" w2 ray/mp = {ratio:.4f} (within 3 %?)")
sys.exit(0 if abs(ratio - 1) <= 0.03 else 1)
EOF
fi
echo "done in $(( $(date +%s) - t0 )) s; status $status"
exit $status
