"""Time the CUDA kernels against the torch reference path on Llama-3-8B shapes (bf16).

Each op is captured N times in one CUDA graph, replayed under CUDA events after warm-up, and the
median per-call time reported, so Python launch overhead is left out. Run from the repository
root: `python benchmarks/gpu/bench_kernels.py` (benchmarks/gpu/run_all.sh does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.gpu_timing import graph_time_us
from zllm.workers import kernels
from zllm.workers.attention import AttentionMetadata, paged_attention, write_kv_cache
from zllm.workers.layers import apply_rotary, rms_norm, silu_and_mul

DEVICE = "cuda"
DTYPE = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, BLOCK = 32, 8, 128, 4096, 14336, 16
CALLS_PER_GRAPH, REPLAYS = 20, 15


def time_us(fn: Callable[[], object]) -> float | None:
    """Median microseconds per call of fn, captured CALLS_PER_GRAPH times in a graph."""
    try:
        return graph_time_us(lambda _: fn(), CALLS_PER_GRAPH, REPLAYS)
    except Exception as exc:  # a reference op that cannot be captured, or out of memory
        print(f"  (not timed: {type(exc).__name__}: {str(exc)[:120]})")
        return None
    finally:
        torch.cuda.synchronize()


def decode_case(batch: int, context: int, with_reference: bool) -> tuple[str, float | None, float | None, float]:
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    tables = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    ours = time_us(
        lambda: kernels.paged_attention_decode(out, query, cache, tables, seq_lens, scale, max_seq_len=context)
    )
    ref = None
    if with_reference:
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long, device=DEVICE),
            block_tables=tables.long(),
            seq_lens=seq_lens.long(),
            seq_lens_list=[context] * batch,
            query_start_loc=list(range(batch + 1)),
            num_decodes=batch,
            block_size=BLOCK,
        )
        ref = time_us(lambda: paged_attention(query, cache, meta, scale))
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * cache.element_size()
    cache = None  # free the GPU memory before the next shape
    torch.cuda.empty_cache()
    return f"decode attention B={batch} L={context}", ours, ref, kv_bytes


def main() -> None:
    print("kernel modules:", kernels.preload())
    rows: list[tuple[str, float | None, float | None, float]] = []
    for batch, context in [(1, 512), (1, 4096), (1, 32768), (64, 512), (64, 4096), (256, 512), (256, 2048)]:
        rows.append(decode_case(batch, context, with_reference=batch * context <= 64 * 4096))

    for tokens in (1, 256):
        x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=DTYPE)
        w = torch.randn(HIDDEN, device=DEVICE, dtype=DTYPE)
        out = torch.empty_like(x)
        residual = torch.randn_like(x)
        nbytes = 3 * x.numel() * 2
        rows.append(
            (
                f"rms_norm T={tokens}",
                time_us(lambda: kernels.rms_norm(out, x, w, 1e-5)),
                time_us(lambda: rms_norm(x, w, 1e-5)),
                nbytes,
            )
        )
        rows.append(
            (
                f"fused_add_rms_norm T={tokens}",
                time_us(lambda: kernels.fused_add_rms_norm(x, residual, w, 1e-5)),
                time_us(lambda: rms_norm(x + residual, w, 1e-5)),
                5 * x.numel() * 2,
            )
        )
        gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device=DEVICE, dtype=DTYPE)
        act = torch.empty(tokens, INTERMEDIATE, device=DEVICE, dtype=DTYPE)
        rows.append(
            (
                f"silu_and_mul T={tokens}",
                time_us(lambda: kernels.silu_and_mul(act, gate_up)),
                time_us(lambda: silu_and_mul(gate_up)),
                3 * act.numel() * 2,
            )
        )
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE, dtype=DTYPE)
        q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
        cos = torch.randn(8192, HEAD_DIM // 2, device=DEVICE)
        sin = torch.randn(8192, HEAD_DIM // 2, device=DEVICE)
        positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
        rows.append(
            (
                f"rotary_embedding T={tokens}",
                time_us(lambda: kernels.rotary_embedding(positions, q, k, cos, sin)),
                time_us(
                    lambda: (
                        apply_rotary(q, cos[positions], sin[positions]),
                        apply_rotary(k, cos[positions], sin[positions]),
                    )
                ),
                2 * (q.numel() + k.numel()) * 2,
            )
        )
        cache = torch.randn(2, 4096, BLOCK, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        slots = torch.randperm(4096 * BLOCK, device=DEVICE)[:tokens]
        rows.append(
            (
                f"reshape_and_cache T={tokens}",
                time_us(lambda: kernels.reshape_and_cache(cache, k, v, slots)),
                time_us(lambda: write_kv_cache(cache, k, v, slots)),
                4 * k.numel() * 2,
            )
        )

    print()
    print(f"{'op (bf16, Llama-3-8B shapes)':40} {'kernel us':>10} {'torch us':>10} {'speedup':>8} {'kernel GB/s':>12}")
    for name, ours, ref, nbytes in rows:
        speedup = f"{ref / ours:7.2f}x" if ours and ref else "-"
        gbps = f"{nbytes / (ours * 1e3):12.0f}" if ours else "-"
        print(f"{name:40} {ours or float('nan'):10.1f} {ref or float('nan'):10.1f} {speedup:>8} {gbps:>12}")


if __name__ == "__main__":
    main()
