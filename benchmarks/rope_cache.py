"""rotary_embedding_and_cache's two kernels, scalar and vectorized (ZLLM_ROPE_VEC), timed as a
step runs them: one call per layer, 32 layers' worth captured in a CUDA graph (gpu_timing).

    python benchmarks/rope_cache.py [--tokens 1,2,4,...,8192] [--heads 32,8] [--head-dim 128]

The engine's layout: q, k and v are views of one qkv projection output; the cache is 16-token
blocks of the model dtype or FP8. Prints one JSON line per (cache dtype, tokens): µs per call of
each kernel, and the bytes it must move at least (q and k read and written, v read, k and v
stored) per µs.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.gpu_timing import graph_time_us
from zllm.workers import kernels
from zllm.workers.attention import KV_FP8
from zllm.workers.layers import rope_cos_sin_cache, rope_inv_freq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,256,512,2048,8192")
    parser.add_argument("--heads", default="32,8", help="query heads, KV heads (Llama-3-8B: 32,8)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    num_heads, kv_heads = (int(h) for h in args.heads.split(","))
    dtype, head_dim = getattr(torch, args.dtype), args.head_dim
    cos, sin = (t.cuda() for t in rope_cos_sin_cache(rope_inv_freq(head_dim, 500000.0, {}), 8192))
    for cache_dtype in ("model", "fp8"):
        for tokens in [int(t) for t in args.tokens.split(",")]:
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            block_size = 16
            num_blocks = -(-tokens // block_size) + 1
            qkv = [
                torch.randn(tokens, (num_heads + 2 * kv_heads) * head_dim, generator=gen, device="cuda").to(dtype)
                for _ in range(args.layers)
            ]
            cache_type = KV_FP8 if cache_dtype == "fp8" else dtype
            caches = [
                torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device="cuda", dtype=cache_type)
                for _ in range(args.layers)
            ]
            positions = torch.randint(0, 8192, (tokens,), generator=gen, device="cuda")
            slots = torch.randperm(num_blocks * block_size, generator=gen, device="cuda")[:tokens]
            split = [num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

            def call(layer: int, vectorized: bool) -> None:
                q, k, v = qkv[layer].split(split, dim=-1)
                kernels.rotary_embedding_and_cache(
                    positions,
                    q.view(tokens, num_heads, head_dim),
                    k.view(tokens, kv_heads, head_dim),
                    v.view(tokens, kv_heads, head_dim),
                    cos,
                    sin,
                    caches[layer],
                    slots,
                    vectorized=vectorized,
                )

            cache_bytes = 1 if cache_dtype == "fp8" else qkv[0].element_size()
            moved = (
                tokens
                * head_dim
                * (
                    (num_heads + kv_heads) * 2 * qkv[0].element_size()  # q and k read and written
                    + kv_heads * qkv[0].element_size()  # v read
                    + 2 * kv_heads * cache_bytes  # k and v stored
                )
            )
            row = {"benchmark": "rope_cache", "cache": cache_dtype, "tokens": tokens}
            for name, vectorized in (("scalar", False), ("vec", True)):
                us = graph_time_us(lambda i, v=vectorized: call(i, v), args.layers, args.replays)
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_GBps"] = round(moved / us / 1e3, 1)
            row["gpu"] = torch.cuda.get_device_name(0)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
