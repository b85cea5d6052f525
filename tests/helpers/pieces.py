"""Steps through the piecewise pieces (zllm/workers/piecewise_graphs.py) against the model's own
forward of the same step from the same cache, and both against the step in a wider dtype: what
the CPU tests (EagerPieces) and the GPU tests (captured pieces) check.

A padded step is not always bit for bit the unpadded one: a GEMM over more rows may take another
kernel and another summation order (docs/architecture.md, "Which outputs are bit-stable"). What
the pieces do promise is to be no further from the exact result than the eager forward, which
rounds the same arithmetic in the same dtype: `ErrorTally`."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch

# Over a run, ||pieces - exact|| <= L2_FACTOR * ||eager - exact|| + eps * ||exact|| and the same
# for the largest single error with MAX_FACTOR. Both paths round the same products in the same
# dtype and differ only in summation orders, so their errors have one distribution: over the runs
# of tests/test_models.py and four tiny models (fp32 on CPU against fp64) the two L2 norms agreed
# within 0.3% and the largest errors were equal. A single step of a few tokens is one small draw
# (ratios up to 3 in L2 and 5 in the largest error there), so the bound holds for the run, not
# per step. eps * |exact| (one ulp at |exact| or more) covers errors that are a single rounding.
L2_FACTOR = 2.0
MAX_FACTOR = 4.0


class ErrorTally:
    """The pieces' and the eager forward's errors against the wide forward, summed over a run."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.squares = {"pieces": 0.0, "eager": 0.0, "exact": 0.0}
        self.largest = {"pieces": 0.0, "eager": 0.0, "exact": 0.0}
        self.eps = 0.0

    def add(self, pieces: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
        if exact.numel() == 0:
            return
        self.eps = torch.finfo(pieces.dtype).eps  # eps * |x| >= the ulp at |x|
        exact = exact.double()
        for name, value in (("pieces", pieces.double() - exact), ("eager", eager.double() - exact), ("exact", exact)):
            self.squares[name] += value.square().sum().item()
            self.largest[name] = max(self.largest[name], value.abs().max().item())

    def summary(self) -> dict[str, dict[str, float]]:
        """The L2 norms and the largest magnitudes: of each path's error, and of the exact values."""
        return {"l2": {name: total**0.5 for name, total in self.squares.items()}, "max": dict(self.largest)}

    def check(self) -> None:
        """The pieces no further from the exact result than L2_FACTOR and MAX_FACTOR times the
        eager forward, plus one ulp."""
        l2, worst = self.summary().values()
        assert l2["exact"] > 0, self.label  # something was compared
        assert l2["pieces"] <= L2_FACTOR * l2["eager"] + self.eps * l2["exact"], (self.label, "L2", l2)
        assert worst["pieces"] <= MAX_FACTOR * worst["eager"] + self.eps * worst["exact"], (self.label, "max", worst)


def watch_steps(runner, check: Callable) -> list[tuple[int, int]]:
    """runner.pieces.run hands each step to check(run, input_ids, positions, meta), `run` the
    original, and returns what check returns; the (tokens, decodes) of each step are listed in
    the returned list as the steps run."""
    seen: list[tuple[int, int]] = []
    original = runner.pieces.run

    def run(input_ids, positions, meta):
        seen.append((input_ids.shape[0], meta.num_decodes))
        return check(original, input_ids, positions, meta)

    runner.pieces.run = run
    return seen


def forward_from(runner, saved: list[torch.Tensor], forward, *args) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`forward`'s hidden states and the caches it left, from runner's caches as saved."""
    for cache, before in zip(runner.kv_caches, saved):
        cache.copy_(before)
    hidden = forward(*args).clone()
    return hidden, [c.clone() for c in runner.kv_caches]


def written_rows(cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The entries a step wrote: [parts, tokens, heads, values] of a [parts, blocks, block_size,
    heads, values] cache at the step's real slots (padded rows have -1: written nowhere)."""
    return cache.flatten(1, 2)[:, slot_mapping[slot_mapping >= 0]]


def unwritten_equal(cache: torch.Tensor, before: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether every entry outside the step's real slots is still what it was before the step."""
    restored = cache.clone()
    slots = slot_mapping[slot_mapping >= 0]
    restored.flatten(1, 2)[:, slots] = before.flatten(1, 2)[:, slots]
    return torch.equal(restored, before)


def _unpacked(meta):
    """The metadata without the packed prefill: FlashAttention takes half precision only, the wide
    forward takes the per-request prefill path."""
    sliding = None if meta.sliding is None else dataclasses.replace(meta.sliding, prefill=None)
    return dataclasses.replace(meta, prefill=None, sliding=sliding)


class WideReference:
    """A copy of the runner's model in a wider dtype (fp32 for a bf16 model on the GPU, fp64 on the
    CPU): the result that the pieces and the eager forward each round."""

    def __init__(self, runner, dtype: torch.dtype) -> None:
        shared = {id(runner.ops): runner.ops}  # the ops hold kernel modules: shared, not copied
        for module in runner.model.modules():
            for name in ("ops", "tp"):
                if hasattr(module, name):
                    shared[id(getattr(module, name))] = getattr(module, name)
        self.model = copy.deepcopy(runner.model, shared).to(dtype)
        self.dtype = dtype

    def forward(self, saved: list[torch.Tensor], input_ids, positions, meta) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step's hidden states and caches, from the saved caches widened."""
        caches = [c.to(self.dtype) for c in saved]
        return self.model(input_ids, positions, caches, _unpacked(meta)), caches


def row_errors(x: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Each token's relative L2 error against `exact`, x and exact [tokens, ...]."""
    diff = (x.double() - exact.double()).flatten(1).norm(dim=1)
    return diff / exact.double().flatten(1).norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
