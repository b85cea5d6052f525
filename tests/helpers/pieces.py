"""Steps through the piecewise pieces (zllm/workers/piecewise_graphs.py) against the model's own
forward of the same step from the same cache, and both against the step in a wider dtype: what
the CPU tests (EagerPieces) and the GPU tests (captured pieces) check.

A padded step is not always bit for bit the unpadded one: a GEMM over more rows may take another
kernel and another summation order (docs/architecture.md, "Which outputs are bit-stable"). What
the pieces do promise is to be no further from the exact result than the eager forward, which
rounds the same arithmetic in the same dtype: `assert_no_further_than_eager`."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch

# ||pieces - exact|| <= L2_FACTOR * ||eager - exact|| + eps * ||exact||, and the same for the
# largest single error with MAX_FACTOR. Both paths round the same products in the same dtype and
# differ only in summation orders, so their errors have the same distribution: over a step's
# ~1e5-1e6 values the L2 norms agree to a few percent (2 leaves room for a step of a few rows),
# while the largest of them is one draw from the tail (4). eps * |exact| (one ulp at |exact| or
# more) covers a step where the eager forward happens to be exact.
L2_FACTOR = 2.0
MAX_FACTOR = 4.0


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


def assert_no_further_than_eager(pieces: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, label) -> None:
    """The pieces' error against `exact` (the wide forward) is within L2_FACTOR (whole tensor) and
    MAX_FACTOR (largest element) of the eager forward's own, plus one ulp of their dtype."""
    if exact.numel() == 0:
        return
    exact = exact.double()
    ours, theirs = pieces.double() - exact, eager.double() - exact
    eps = torch.finfo(pieces.dtype).eps  # eps * |x| >= the ulp at |x|
    l2 = (ours.norm().item(), theirs.norm().item(), eps * exact.norm().item())
    worst = (ours.abs().max().item(), theirs.abs().max().item(), eps * exact.abs().max().item())
    assert l2[0] <= L2_FACTOR * l2[1] + l2[2], (label, "L2 error: pieces, eager, ulp", l2)
    assert worst[0] <= MAX_FACTOR * worst[1] + worst[2], (label, "largest error: pieces, eager, ulp", worst)


def row_errors(x: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Each token's relative L2 error against `exact`, x and exact [tokens, ...]."""
    diff = (x.double() - exact.double()).flatten(1).norm(dim=1)
    return diff / exact.double().flatten(1).norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
