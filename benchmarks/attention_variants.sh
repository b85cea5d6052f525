#!/usr/bin/env bash
# Decode attention at large batches: the kernel's tuning constants swept, each variant compiled
# with NVRTC from a patched copy of the tree (csrc/, and zllm/ where the launch must agree) and
# timed by benchmarks/attention_decode.py.
#   bash benchmarks/attention_variants.sh [BATCH] [CONTEXTS]     (defaults: 256, 400,1024)
# Prints one JSON line per (variant, context) with the variant's name added.
set -uo pipefail
cd "$(dirname "$0")/.."
batch=${1:-256}
contexts=${2:-400,1024}
variants=(
  "base|"
  "qk16|s/#define ZLLM_QK_BATCH 8 /#define ZLLM_QK_BATCH 16 /"
  "pv32|s/#define ZLLM_PV_BATCH 16 /#define ZLLM_PV_BATCH 32 /"
  "minblocks2|s/#define ZLLM_ATTN_MIN_BLOCKS_16BIT 4/#define ZLLM_ATTN_MIN_BLOCKS_16BIT 2/"
  "minblocks6|s/#define ZLLM_ATTN_MIN_BLOCKS_16BIT 4/#define ZLLM_ATTN_MIN_BLOCKS_16BIT 6/"
  "warps8|s/constexpr int kAttnWarps = 4;/constexpr int kAttnWarps = 8;/;s/#define ZLLM_ATTN_MIN_BLOCKS_16BIT 4/#define ZLLM_ATTN_MIN_BLOCKS_16BIT 2/"
)
root=$PWD
for entry in "${variants[@]}"; do
  name=${entry%%|*}
  script=${entry#*|}
  dir=$(mktemp -d)
  cp -r "$root/csrc" "$root/zllm" "$root/benchmarks" "$dir/"
  # The constants live in attention.cuh (since the window kernels got a file of their own; until
  # then in attention_kernels.cu, which this patched on 2026-11-24): a sed that changes nothing
  # would time the base kernel under another name, so that is an error.
  if [ -n "$script" ]; then
    sed -i "$script" "$dir/csrc/attention.cuh"
    if cmp -s "$root/csrc/attention.cuh" "$dir/csrc/attention.cuh"; then
      echo "variant $name: its sed changed nothing in csrc/attention.cuh" >&2
      rm -rf "$dir"
      continue
    fi
  fi
  [ "$name" = warps8 ] && sed -i 's/^_ATTN_THREADS = 128 /_ATTN_THREADS = 256 /' "$dir/zllm/workers/kernels/attention.py"
  cd "$dir"
  PYTHONPATH="$dir:${PYTHONPATH:-}" ZLLM_CSRC_DIR="$dir/csrc" ZLLM_KERNELS=nvrtc CUPY_CACHE_DIR="$dir/cupy" \
    python -m benchmarks.attention_decode --batch-size "$batch" --capacity 1024 --contexts "$contexts" \
      --partition-sizes default,256 2>&1 | grep '^{' | sed "s/^{/{\"variant\": \"$name\", /"
  cd "$root"
  rm -rf "$dir"
done
