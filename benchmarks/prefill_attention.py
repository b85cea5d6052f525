"""Prefill attention on the GPU: which of PyTorch's SDPA paths serves the paged prefill.

    python benchmarks/prefill_attention.py

For chunks of new tokens that attend causally to a cached prefix (Llama-3-8B heads: 32 query,
8 KV, head_dim 128, bf16): the torch reference path (gather the request's blocks, SDPA with
enable_gqa and, with a prefix, a boolean mask) with SDPA left to choose and forced to each
backend, and the GPU worker's path (CudaOps.prefill_attention: expanded KV heads and a
lower-right causal bias). Prints one JSON line per case (median of 20 runs, CUDA events).

Then whole steps (`--steps`): the prefill requests of one step through the per-request loop
(CudaOps.prefill_attention per request) and packed into one FlashAttention call
(ops.packed_prefill_attention), one layer's attention, with the host time of the launches
included (each timed call starts after a device sync), and the largest difference between them.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from zllm.workers.attention import AttentionMetadata, _prefill_attention, pack_prefill, packed_prefill_of
from zllm.workers.ops import CudaOps

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def case(prefix: int, chunk: int) -> dict:
    seq = prefix + chunk
    blocks = -(-seq // BLOCK)
    cache = torch.randn(2, blocks * 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(blocks * 2, device="cuda")[:blocks][None].to(torch.int32)
    query = torch.randn(chunk, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0),
        block_tables=table,
        seq_lens=torch.tensor([seq]),
        seq_lens_list=[seq],
        query_start_loc=[0, chunk],
        num_decodes=0,
        block_size=BLOCK,
    )
    result = {"prefix": prefix, "chunk": chunk}
    for name, backends in [
        ("auto", None),
        ("flash", [SDPBackend.FLASH_ATTENTION]),
        ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
        ("math", [SDPBackend.MATH]),
    ]:
        try:
            result[f"{name}_us"] = round(
                time_us(lambda: _prefill_attention(query, cache, meta, 0, HEAD_DIM**-0.5), backends), 1
            )
        except RuntimeError as error:  # a backend may refuse the shape or mask
            result[f"{name}_us"] = f"unsupported: {str(error).splitlines()[0][:80]}"
    ops = CudaOps(torch.device("cuda"))
    result["worker_us"] = round(time_us(lambda: ops.prefill_attention(query, cache, meta, 0, HEAD_DIM**-0.5), None), 1)
    reference = _prefill_attention(query, cache, meta, 0, HEAD_DIM**-0.5).float()
    ours = ops.prefill_attention(query, cache, meta, 0, HEAD_DIM**-0.5).float()
    result["worker_max_abs_diff"] = round((reference - ours).abs().max().item(), 5)
    return result


def time_us(fn, backends, sync_first: bool = False) -> float:
    """Median of 20 timed calls. With sync_first, each call starts on an idle device, so launch
    (host) time the GPU cannot hide behind queued work counts too."""
    context = sdpa_kernel(backends) if backends else torch.autograd.profiler.record_function("auto")
    with context:
        for _ in range(3):
            fn()
        times = []
        for _ in range(20):
            if sync_first:
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


# (cached prefix, new tokens) of each prefill request in one step.
STEP_CASES = {
    "soak step: 16 prompts of 16-256 tokens": [(0, n) for n in np.random.default_rng(0).integers(16, 257, 16)],
    "W1 mixed step: 32 prompts of 256": [(0, 256)] * 32,
    "serving step: 2 prompts of 256": [(0, 256)] * 2,
    "chunked: 4 chunks of 512 after 512-3072 cached": [(512, 512), (1024, 512), (2048, 512), (3072, 512)],
}


def step_case(name: str, requests: list[tuple[int, int]]) -> dict:
    seq_lens = [prefix + new for prefix, new in requests]
    query_start_loc = np.concatenate(([0], np.cumsum([new for _, new in requests]))).tolist()
    blocks = [-(-n // BLOCK) for n in seq_lens]
    table = np.zeros((len(requests), max(blocks)), dtype=np.int64)
    order = np.random.default_rng(1).permutation(sum(blocks))
    for row, first in enumerate(np.cumsum([0] + blocks[:-1])):
        table[row, : blocks[row]] = order[first : first + blocks[row]]
    cache = torch.randn(2, sum(blocks), BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(query_start_loc[-1], HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0),
        block_tables=torch.from_numpy(table).to("cuda", torch.int32),
        seq_lens=torch.tensor(seq_lens, device="cuda"),
        seq_lens_list=seq_lens,
        query_start_loc=query_start_loc,
        num_decodes=0,
        block_size=BLOCK,
    )
    slots, cu = pack_prefill(table, seq_lens, query_start_loc, 0, BLOCK)
    packed = packed_prefill_of(
        torch.from_numpy(slots).cuda(), torch.from_numpy(cu).cuda(), seq_lens, query_start_loc, 0
    )
    ops = CudaOps(torch.device("cuda"))

    def run(layout):
        meta.prefill = layout
        return ops.attention(query, cache, meta, HEAD_DIM**-0.5)

    result = {"step": name, "requests": len(requests), "tokens": query_start_loc[-1]}
    result["loop_us"] = round(time_us(lambda: run(None), None, sync_first=True), 1)
    result["packed_us"] = round(time_us(lambda: run(packed), None, sync_first=True), 1)
    result["speedup"] = round(result["loop_us"] / result["packed_us"], 2)
    result["max_abs_diff"] = round((run(None).float() - run(packed).float()).abs().max().item(), 5)
    return result


if __name__ == "__main__":
    for prefix, chunk in [(0, 128), (0, 512), (0, 2048), (512, 512), (3072, 1024), (7680, 512)]:
        print(json.dumps(case(prefix, chunk)), flush=True)
    for name, requests in STEP_CASES.items():
        print(json.dumps(step_case(name, requests)), flush=True)
