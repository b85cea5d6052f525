"""Decode paged attention on its own: microseconds per call of zllm's kernel, as a decode step
runs it (captured in a CUDA graph whose grid is sized for the block table's capacity, one call
per layer back to back), for short and long contexts, and the K/V bandwidth that makes.

    python benchmarks/attention_decode.py --batch-sizes 8,256,512 --contexts 400,1024,4096 \\
        --partition-sizes default --builds classic,pipe,pipe3

Llama-3-8B attention shape by default (32 query heads, 8 KV heads, head_dim 128, bf16). Prints
one JSON line per (batch, context, partition size, build); partition "default" is what the engine
picks, build is ZLLM_DECODE_ATTENTION's (classic: csrc/attention.cuh, pipe/pipe3:
csrc/attention_pipe.cuh). The block table's capacity is --capacity or the context, whichever is
larger (W1's graphs: 1024). Each call of the graph reads its own copy of the cache while the copies
together are smaller than 4x the L2 (a layer's cache), so small batches are not timed out of L2.
TB/s counts the K and V bytes of the real contexts (not the dead partitions' nothing).

--long-context N gives the batch's last sequence N tokens (one long context among short ones);
--loops 0,1 times each shape with ZLLM_DECODE_PARTITION_LOOP off, then on; grid_x and kernel say
what ran (the _loop kernels: one wave of blocks, whatever the capacity):

    python benchmarks/attention_decode.py --batch-sizes 88 --contexts 400 --capacity 32768 \
        --long-context 32000 --partition-sizes default --loops 0,1
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.gpu_timing import graph_time_us
from zllm.workers import kernels

CALLS_PER_GRAPH = 32  # one per layer of an 8B model
REPLAYS = 20
L2_MULTIPLE = 4  # distinct caches until their bytes pass this many L2s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", default="1")
    parser.add_argument("--capacity", type=int, default=1024, help="block-table capacity in tokens (max_model_len)")
    parser.add_argument("--contexts", default="129,256,384,1024")
    parser.add_argument("--partition-sizes", default="default,128,256,512")
    parser.add_argument("--builds", default="pipe", help="comma-separated ZLLM_DECODE_ATTENTION values")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--long-context", type=int, default=0, help="tokens of the batch's last sequence (0: context)")
    parser.add_argument("--loops", default=None, help="ZLLM_DECODE_PARTITION_LOOP values to time, e.g. 0,1")
    args = parser.parse_args()
    kernels.preload()
    grids = _record_decode_grids()
    loops = [None] if args.loops is None else args.loops.split(",")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            for loop in loops:
                if loop is not None:
                    os.environ["ZLLM_DECODE_PARTITION_LOOP"] = loop
                for row in time_shape(args, batch, context, grids):
                    print(json.dumps({**row, "partition_loop": loop}), flush=True)


def time_shape(args: argparse.Namespace, batch: int, context: int, grids: list[tuple[int, str]]) -> list[dict]:
    """Every (partition size, build) of one batch and context; grids: the launches recorded."""
    device = torch.device("cuda")
    block = args.block_size
    lens = [context] * batch
    if args.long_context:
        lens[-1] = args.long_context
    max_blocks = -(-max(args.capacity, *lens) // block)
    capacity = max_blocks * block
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    num_blocks = batch * max_blocks + 1
    shape = (2, num_blocks, block, args.kv_heads, args.head_dim)
    cache_bytes = torch.Size(shape).numel() * cache_dtype.itemsize
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(1, min(CALLS_PER_GRAPH, -(-L2_MULTIPLE * l2 // cache_bytes)))
    caches = [torch.randn(shape, device=device, dtype=torch.bfloat16).to(cache_dtype) for _ in range(copies)]
    tables = torch.randperm(num_blocks - 1, device=device, dtype=torch.int32)[: batch * max_blocks].view(
        batch, max_blocks
    )
    query = torch.randn(batch, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = args.head_dim**-0.5
    kv_bytes = 2 * sum(lens) * args.kv_heads * args.head_dim * cache_dtype.itemsize
    rows = []
    for size in args.partition_sizes.split(","):
        partition = None if size == "default" else int(size)
        chosen, parts = kernels.attention_partitions(
            batch, args.heads, args.kv_heads, capacity, device, partition, block
        )
        for build in args.builds.split(","):
            micros = graph_time_us(
                lambda i, build=build: kernels.paged_attention_decode(
                    out, query, caches[i % copies], tables, seq_lens, scale, partition_size=partition, build=build
                ),
                CALLS_PER_GRAPH,
                REPLAYS,
            )
            rows.append(
                {
                    "benchmark": "attention_decode",
                    "build": build,
                    "batch_size": batch,
                    "context": context,
                    "long_context": args.long_context,
                    "capacity": capacity,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "partition_size": chosen,
                    "grid_partitions": parts,
                    "grid_x": grids[-1][0],
                    "kernel": grids[-1][1],
                    "requested": size,
                    "us_per_call": round(micros, 2),
                    "kv_TBps": round(kv_bytes / micros / 1e6, 3),
                    "cache_copies": copies,
                    "gpu": torch.cuda.get_device_name(0),
                }
            )
    caches.clear()  # the next shape allocates its own
    torch.cuda.empty_cache()
    return rows


def _record_decode_grids() -> list[tuple[int, str]]:
    """(grid x: partitions, or the _loop kernels' blocks; kernel) of every decode
    attention launch from here on."""
    seen: list[tuple[int, str]] = []
    real = kernels.attention.launch

    def record(module, kernel, device, grid, *args, **kwargs):
        if kernel.startswith("paged_attention_decode"):
            seen.append((grid[0], kernel))
        return real(module, kernel, device, grid, *args, **kwargs)

    kernels.attention.launch = record
    return seen


if __name__ == "__main__":
    main()
