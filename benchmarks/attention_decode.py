"""Decode paged attention on its own: microseconds per call of zllm's kernel, as a decode step
runs it (captured in a CUDA graph whose grid is sized for the block table's capacity, one call
per layer back to back), for short and long contexts.

    python benchmarks/attention_decode.py --batch-size 1 --capacity 1024 --contexts 129,256,384,1024

Llama-3-8B attention shape by default (32 query heads, 8 KV heads, head_dim 128, bf16). Prints
one JSON line per (context, partition size); partition "default" is what the engine picks.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.gpu_timing import graph_time_us
from zllm.workers import kernels

CALLS_PER_GRAPH = 32  # one per layer of an 8B model
REPLAYS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=1024, help="block-table capacity in tokens (max_model_len)")
    parser.add_argument("--contexts", default="129,256,384,1024")
    parser.add_argument("--partition-sizes", default="default,128,256,512")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    device = torch.device("cuda")
    block, batch = args.block_size, args.batch_size
    max_blocks = -(-args.capacity // block)
    num_blocks = batch * max_blocks + 1
    cache = torch.randn(2, num_blocks, block, args.kv_heads, args.head_dim, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks - 1, device=device, dtype=torch.int32)[: batch * max_blocks].view(
        batch, max_blocks
    )
    query = torch.randn(batch, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    scale = args.head_dim**-0.5
    kernels.preload()
    for context in (int(c) for c in args.contexts.split(",")):
        if context > max_blocks * block:
            continue
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        for size in args.partition_sizes.split(","):
            partition = None if size == "default" else int(size)
            chosen, parts = kernels.attention_partitions(
                batch, args.heads, args.kv_heads, max_blocks * block, device, partition
            )
            micros = graph_time_us(
                lambda _: kernels.paged_attention_decode(
                    out, query, cache, tables, seq_lens, scale, partition_size=partition
                ),
                CALLS_PER_GRAPH,
                REPLAYS,
            )
            print(
                json.dumps(
                    {
                        "benchmark": "attention_decode",
                        "batch_size": batch,
                        "context": context,
                        "capacity": max_blocks * block,
                        "partition_size": chosen,
                        "grid_partitions": parts,
                        "requested": size,
                        "us_per_call": round(micros, 2),
                        "gpu": torch.cuda.get_device_name(0),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
