"""Decode attention on the CPU: the torch reference (gather each request's blocks, then SDPA) vs the
csrc/cpu kernel that reads the paged cache in place.

    python benchmarks/cpu_attention.py
    python benchmarks/cpu_attention.py --batch 64 --context 16:512 --layers 30 --steps 5

One "step" is one decode batch through every layer (each layer its own cache, as in the model),
SmolLM2-135M's attention shapes by default: 9 heads, 3 KV heads, head_dim 64, block size 16,
fp32. Context lengths are uniform in the given range (seed 0); requests are sorted shortest
first and their blocks shuffled, as the model runner and block pool leave them. Prints one
JSON line: the median step time of each path, their ratio, and the largest output difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from zllm.workers.attention import AttentionMetadata, decode_attention
from zllm.workers.kernels import cpu as cpu_kernels


def build_batch(args) -> tuple[torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    rng = random.Random(args.seed)
    low, _, high = args.context.partition(":")
    seq_lens = sorted(rng.randint(int(low), int(high or low)) for _ in range(args.batch))
    blocks_per_seq = [-(-n // args.block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    block_tables = torch.zeros(args.batch, max(blocks_per_seq), dtype=torch.long)
    for row, count in enumerate(blocks_per_seq):
        block_tables[row, :count] = torch.tensor([pool.pop() for _ in range(count)])
    caches = [torch.randn(2, num_blocks, args.block_size, args.kv_heads, args.head_dim) for _ in range(args.layers)]
    query = torch.randn(args.batch, args.heads, args.head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(args.batch, dtype=torch.long), block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens), seq_lens_list=seq_lens, query_start_loc=list(range(args.batch + 1)),
        num_decodes=args.batch, block_size=args.block_size,
    )  # fmt: skip
    return query, caches, meta


def median_step_s(step, steps: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", default="16:512")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not cpu_kernels.is_available():
        raise SystemExit("the CPU kernel did not build here (see the warning above)")

    query, caches, meta = build_batch(args)
    scale = args.head_dim**-0.5
    out = torch.empty_like(query)

    def reference_step() -> None:
        for cache in caches:
            decode_attention(query, cache, meta, scale)

    def kernel_step() -> None:
        for cache in caches:
            cpu_kernels.paged_attention_decode(out, query, cache, meta.block_tables, meta.seq_lens, scale)

    reference_s = median_step_s(reference_step, args.steps)
    kernel_s = median_step_s(kernel_step, args.steps)
    kernel_step()
    diff = (out - decode_attention(query, caches[-1], meta, scale)).abs().max().item()
    kv_bytes = sum(meta.seq_lens_list) * 2 * args.kv_heads * args.head_dim * 4 * args.layers
    print(json.dumps({
        "batch": args.batch, "context": args.context, "layers": args.layers, "threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "reference_ms_per_step": round(reference_s * 1e3, 2), "kernel_ms_per_step": round(kernel_s * 1e3, 2),
        "speedup": round(reference_s / kernel_s, 2), "kernel_kv_gb_per_s": round(kv_bytes / kernel_s / 1e9, 1),
        "max_abs_diff": diff,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
