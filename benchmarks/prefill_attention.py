"""Prefill attention on the GPU: which of PyTorch's SDPA paths serves the paged prefill.

    python benchmarks/prefill_attention.py

For chunks of new tokens that attend causally to a cached prefix (Llama-3-8B heads: 32 query,
8 KV, head_dim 128, bf16): the torch reference path (gather the request's blocks, SDPA with
enable_gqa and, with a prefix, a boolean mask) with SDPA left to choose and forced to each
backend, and the GPU worker's path (CudaOps.prefill_attention: expanded KV heads and a
lower-right causal bias). Prints one JSON line per case (median of 20 runs, CUDA events).
"""

from __future__ import annotations

import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from zllm.workers.attention import AttentionMetadata, _prefill_attention
from zllm.workers.ops import CudaOps

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def case(prefix: int, chunk: int) -> dict:
    seq = prefix + chunk
    blocks = -(-seq // BLOCK)
    cache = torch.randn(2, blocks * 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(blocks * 2, device="cuda")[:blocks][None].to(torch.int32)
    query = torch.randn(chunk, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0), block_tables=table, seq_lens=torch.tensor([seq]), seq_lens_list=[seq],
        query_start_loc=[0, chunk], num_decodes=0, block_size=BLOCK,
    )
    result = {"prefix": prefix, "chunk": chunk}
    for name, backends in [("auto", None), ("flash", [SDPBackend.FLASH_ATTENTION]),
                           ("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("math", [SDPBackend.MATH])]:
        try:
            result[f"{name}_us"] = round(time_us(lambda: _prefill_attention(query, cache, meta, 0, HEAD_DIM**-0.5), backends), 1)
        except RuntimeError as error:  # a backend may refuse the shape or mask
            result[f"{name}_us"] = f"unsupported: {str(error).splitlines()[0][:80]}"
    ops = CudaOps()
    result["worker_us"] = round(time_us(lambda: ops.prefill_attention(query, cache, meta, 0, HEAD_DIM**-0.5), None), 1)
    reference = _prefill_attention(query, cache, meta, 0, HEAD_DIM**-0.5).float()
    ours = ops.prefill_attention(query, cache, meta, 0, HEAD_DIM**-0.5).float()
    result["worker_max_abs_diff"] = round((reference - ours).abs().max().item(), 5)
    return result


def time_us(fn, backends) -> float:
    context = sdpa_kernel(backends) if backends else torch.autograd.profiler.record_function("auto")
    with context:
        for _ in range(3):
            fn()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    for prefix, chunk in [(0, 128), (0, 512), (0, 2048), (512, 512), (3072, 1024), (7680, 512)]:
        print(json.dumps(case(prefix, chunk)), flush=True)
