"""Capturing CUDA graphs: the steps the decode graphs (cuda_graphs.py) and the piecewise graphs
(piecewise_graphs.py) share."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_WARMUP_RUNS = 2  # eager runs before a capture: the allocator settles, every kernel is loaded


class GraphCapturer:
    """Captures CUDA graphs into one memory pool: the first capture creates it and every later one
    reuses it, so an owner that captures its largest size first lets the smaller sizes live in
    that size's memory."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, run: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """Run `run` eagerly (warm-up outside the graph), then capture one call of it. Returns the
        graph and what the captured call returned: tensors that every replay rewrites."""
        for _ in range(_WARMUP_RUNS):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, output
