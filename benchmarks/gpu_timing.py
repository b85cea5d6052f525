"""Timing of GPU work as a decode step runs it: calls captured back to back in one CUDA graph,
replayed under CUDA events after a warm-up, so Python launch overhead is left out."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_time_us(fn: Callable[[int], object], calls: int, replays: int) -> float:
    """Median microseconds per call of fn(i), i = 0 .. calls - 1 captured in one graph (fn may use
    i to pick a different operand per call, e.g. a weight matrix per layer)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: module loads, workspaces, cuBLAS handles
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)
