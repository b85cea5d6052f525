"""The exact rejection sampler of speculative decoding (Leviathan et al. 2023, Chen et al. 2023).

A request with k draft tokens d_1..d_k is scored at k + 1 positions in one forward: position j
(0-based) gives the target's distribution p_j of the token after d_1..d_j. Its rows are laid out
consecutively, one "position row" each, and each row's sampling settings already count the drafts
before it as output (SamplingBatch.metadata's `drafted`).

Our proposers are deterministic (n-gram lookup; a draft model's greedy choice), so the draft's
distribution q_j is a point mass on d_{j+1}, and the general rule reduces to:

    accept d_{j+1} with probability p_j(d_{j+1})                  (min(1, p / q) with q = 1)
    on the first rejection, draw from max(0, p_j - q_j) normalised = p_j without d_{j+1}
    when all k are accepted, draw one more token from p_k          (the "bonus" token)

which emits tokens distributed exactly as sampling from the target one by one. A greedy row
accepts d_{j+1} iff it is the argmax, and emits the argmax where it stops: token for token the
output of decoding without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zllm.workers.sampler import SamplingMetadata, exponential_race, target_distribution
from zllm.workers.transfer import to_device

_FEW_REQUESTS = 8  # up to this many requests, host_indices builds lists (measured: the crossover is ~12)


@dataclass(slots=True)
class DraftLayout:
    """Where each sampling request's position rows are: request r owns rows
    first_row[r] .. first_row[r] + len(drafts[r]) (its drafts' rows, then its bonus row)."""

    drafts: list[list[int]]
    first_row: list[int]

    @classmethod
    def of(cls, drafts: list[list[int]]) -> DraftLayout:
        first, rows = [], 0
        for request_drafts in drafts:
            first.append(rows)
            rows += len(request_drafts) + 1
        return cls(drafts, first)

    @property
    def num_rows(self) -> int:
        return sum(len(d) + 1 for d in self.drafts)

    @property
    def width(self) -> int:
        """Tokens a request may gain: its drafts, then one of the target's."""
        return 1 + max((len(d) for d in self.drafts), default=0)

    def drafted_before(self) -> list[list[int]]:
        """Per position row, the drafts that come before it (SamplingBatch.metadata's `drafted`)."""
        return [drafts[:j] for drafts in self.drafts for j in range(len(drafts) + 1)]

    def row_drafts(self) -> list[int]:
        """Per position row, the draft token it scores (-1 for a bonus row)."""
        return [token for drafts in self.drafts for token in (*drafts, -1)]

    def host_indices(self) -> np.ndarray:
        """Every integer the sampler needs, made on the host and packed for one copy: per row its
        draft (-1: bonus) and its slot r * width + offset in the [R, width] grid; per slot (request
        r, offset) the row it reads (past the request's rows: its bonus row, never accepted) and
        that row's draft; the offsets 0 .. width - 1."""
        if len(self.drafts) <= _FEW_REQUESTS:
            return self._host_indices_by_lists()
        width = self.width
        counts = np.fromiter(map(len, self.drafts), dtype=np.int64, count=len(self.drafts)) + 1
        first = np.asarray(self.first_row, dtype=np.int64)
        offsets = np.arange(width, dtype=np.int64)
        index = first[:, None] + np.minimum(offsets[None, :], counts[:, None] - 1)
        row_drafts = np.asarray(self.row_drafts(), dtype=np.int64)
        row_slot = np.flatnonzero(offsets[None, :] < counts[:, None])  # row-major: the rows in order
        return np.concatenate([row_drafts, row_slot, index.ravel(), row_drafts[index].ravel(), offsets])

    def _host_indices_by_lists(self) -> np.ndarray:
        """host_indices for a few requests: list appends cost less than numpy's calls there."""
        width = self.width
        row_drafts, row_slot, index, slot_drafts = [], [], [], []
        for request, (drafts, first) in enumerate(zip(self.drafts, self.first_row)):
            count = len(drafts) + 1
            row_drafts += drafts
            row_drafts.append(-1)
            row_slot += range(request * width, request * width + count)
            index += range(first, first + count)
            index += [first + count - 1] * (width - count)
            slot_drafts += drafts
            slot_drafts += [-1] * (width - count + 1)
        return np.array(row_drafts + row_slot + index + slot_drafts + list(range(width)), dtype=np.int64)


@dataclass(slots=True)
class Verified:
    """The tokens each request gains: `tokens[r, :num_tokens[r]]` ([R, width], -1 beyond), and
    per position row the token it emits when it is reached (`row_tokens()`, for logprobs)."""

    tokens: torch.Tensor
    num_tokens: torch.Tensor
    slot_tokens: torch.Tensor  # [R, width]: per slot, its draft inside the accepted run, else what it emits
    row_slot: torch.Tensor

    def row_tokens(self) -> torch.Tensor:
        return self.slot_tokens.view(-1)[self.row_slot]


def verify(logits: torch.Tensor, meta: SamplingMetadata, layout: DraftLayout) -> Verified:
    """logits [rows, V] of every position row (with meta for those rows) -> the tokens gained.
    One host-to-device copy (pinned: it queues behind the forward) and no host sync."""
    indices = _Indices.of(layout, logits.device)
    greedy, probs = target_distribution(logits, meta)
    if probs is None:  # every row greedy: a draft is accepted iff it is the argmax
        emitted = greedy[indices.index]
        return _gather_per_request(emitted == indices.slot_drafts, emitted, indices, greedy=True)
    row_drafts = indices.row_drafts
    is_draft = row_drafts >= 0
    drafts_or_zero = row_drafts.clamp(min=0)
    uniform = _uniforms(probs.shape[0], meta, logits.device)
    draft_prob = probs.gather(1, drafts_or_zero[:, None]).squeeze(1)
    random_accepted = uniform < draft_prob
    # The residual max(0, p - onehot(d)): p with the draft's entry removed (a bonus row keeps p).
    residual = probs.scatter(1, drafts_or_zero[:, None], 0.0)
    residual = torch.where(is_draft[:, None], residual, probs)
    random_emitted = exponential_race(residual, meta.generators)
    is_greedy = meta.temperature == 0.0
    accepted = torch.where(is_greedy, greedy == row_drafts, random_accepted) & is_draft
    emitted = torch.where(is_greedy, greedy, random_emitted)
    return _gather_per_request(accepted[indices.index], emitted[indices.index], indices, greedy=False)


@dataclass(slots=True)
class _Indices:
    """DraftLayout.host_indices on the device, unpacked."""

    row_drafts: torch.Tensor  # [rows]
    row_slot: torch.Tensor  # [rows]
    index: torch.Tensor  # [R, width]
    slot_drafts: torch.Tensor  # [R, width]: -1 at the bonus row and past it
    offsets: torch.Tensor  # [width]

    @classmethod
    def of(cls, layout: DraftLayout, device: torch.device) -> _Indices:
        rows, requests, width = layout.num_rows, len(layout.drafts), layout.width
        packed = to_device(layout.host_indices(), device)
        grid = requests * width
        row_drafts, row_slot, index, slot_drafts, offsets = packed.split([rows, rows, grid, grid, width])
        return cls(row_drafts, row_slot, index.view(requests, width), slot_drafts.view(requests, width), offsets)


def _uniforms(num_rows: int, meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row; a seeded row draws it from its own generator (before its race noise),
    so its tokens repeat whatever the batch."""
    uniform = torch.rand(num_rows, device=device)
    for row, generator in meta.generators.items():
        uniform[row] = torch.rand((), generator=generator, device=device)
    return uniform


def _gather_per_request(accepted: torch.Tensor, emitted: torch.Tensor, indices: _Indices, greedy: bool) -> Verified:
    """From the [R, width] grid of each request's rows: the leading run of accepted drafts, then
    the token the first unaccepted row emits, -1 after it. All on the device: no host sync.
    greedy: inside the accepted run each draft equals what its row emits (the argmax)."""
    run = accepted.cumprod(dim=1, dtype=torch.int32)  # a bonus row (and every slot past it) is never accepted
    num_accepted = run.sum(dim=1)
    slot_tokens = emitted if greedy else torch.where(run.bool(), indices.slot_drafts, emitted)
    tokens = slot_tokens.masked_fill(indices.offsets[None, :] > num_accepted[:, None], -1)
    return Verified(tokens=tokens, num_tokens=num_accepted + 1, slot_tokens=slot_tokens, row_slot=indices.row_slot)
