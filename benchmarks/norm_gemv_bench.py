"""The norm-carrying step's GEMV builds against the plain ones at a 70B tp 4 rank's shapes
(csrc/gemv_kernels.cu kNorm, kAdd; ZLLM_NORM_GEMV), bf16, one GPU: µs per call, each build
launched over 12 copies of its weights in one CUDA graph (no L2 reuse between calls), best of 5
times 10 replays. And the add + RMSNorm kernel the step no longer launches, for scale.

    python benchmarks/norm_gemv_bench.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zllm.workers import kernels
from zllm.workers.kernels import RopeCache

DTYPE = torch.bfloat16
COPIES = 12
HIDDEN = 8192  # Llama-3-70B; a tp 4 rank holds 1/4 of the heads and the intermediate size
INTERMEDIATE = 7168
Q_HEADS, KV_HEADS, HEAD_DIM = 16, 2, 128
EPS = 1e-5


def time_us(launch: Callable[[int], object]) -> float:
    """µs per launch of launch(copy) for COPIES copies captured in one graph, best of 5 x 10 replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(COPIES):
            launch(i)  # loads the module outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(COPIES):
                launch(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / (10 * COPIES))
    return best


def weights(rows: int, cols: int) -> list[torch.Tensor]:
    return [(torch.randn(rows, cols, device="cuda") * 0.02).to(DTYPE) for _ in range(COPIES)]


def row(cols: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(1, cols, device="cuda") * scale).to(DTYPE)


def gate_up(stream: torch.Tensor) -> dict[str, float]:
    w = weights(2 * INTERMEDIATE, HIDDEN)
    out = torch.empty(1, INTERMEDIATE, device="cuda", dtype=DTYPE)
    return {
        "gate_up + silu": time_us(lambda i: kernels.gemv_act_and_mul(out, stream, w[i])),
        "gate_up + silu, norm": time_us(lambda i: kernels.gemv_act_and_mul(out, stream, w[i], norm_eps=EPS)),
    }


def row_parallel(name: str, cols: int, residual: torch.Tensor) -> dict[str, float]:
    w, x = weights(HIDDEN, cols), row(cols)
    out = torch.empty(1, HIDDEN, device="cuda", dtype=DTYPE)
    return {
        name: time_us(lambda i: kernels.gemv(out, x, w[i], None, variant="b6")),
        f"{name}, add": time_us(lambda i: kernels.gemv_add(out, x, w[i], None, residual)),
    }


def qkv(stream: torch.Tensor) -> dict[str, float]:
    n = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
    w = weights(n, HIDDEN)
    cache = torch.zeros(2, 64, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    angles = torch.arange(1024, device="cuda").float()[:, None] * inv_freq[None, :]
    position = torch.tensor([37], device="cuda", dtype=torch.int64)
    slot = torch.tensor([21], device="cuda", dtype=torch.int64)
    rope = RopeCache(position, angles.cos().contiguous(), angles.sin().contiguous(), cache, slot, Q_HEADS)
    out = torch.empty(1, n, device="cuda", dtype=DTYPE)
    return {
        "q/k/v + rope": time_us(lambda i: kernels.gemv_rope_cache(out, stream, w[i], None, rope)),
        "q/k/v + rope, norm": time_us(lambda i: kernels.gemv_rope_cache(out, stream, w[i], None, rope, norm_eps=EPS)),
    }


def main() -> None:
    kernels.preload(torch.device("cuda"))
    stream, residual = row(HIDDEN, 4.0), row(HIDDEN)
    gamma = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(DTYPE)
    results = gate_up(stream)
    results |= row_parallel("down", INTERMEDIATE, residual)
    results |= row_parallel("o", Q_HEADS * HEAD_DIM, residual)
    results |= qkv(stream)
    x = stream.clone()
    results["add + RMSNorm"] = time_us(lambda i: kernels.fused_add_rms_norm(x, residual, gamma, EPS))
    for name, us in results.items():
        print(f"{name:24s} {us:8.2f} us")


if __name__ == "__main__":
    main()
