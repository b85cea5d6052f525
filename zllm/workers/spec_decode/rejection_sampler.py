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
        draft (-1: bonus) and its request; per request its first row; per (request, offset) the
        row it reads (its first row where the offset is past its rows) and whether it is real."""
        counts = np.asarray([len(d) + 1 for d in self.drafts], dtype=np.int64)
        first = np.asarray(self.first_row, dtype=np.int64)
        offsets = np.arange(self.width, dtype=np.int64)
        valid = offsets[None, :] < counts[:, None]
        index = np.where(valid, first[:, None] + offsets[None, :], first[:, None])
        request_of_row = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        row_drafts = np.asarray(self.row_drafts(), dtype=np.int64)
        return np.concatenate([row_drafts, request_of_row, first, index.ravel(), valid.ravel().astype(np.int64)])


@dataclass(slots=True)
class Verified:
    """The tokens each request gains: `tokens[r, :num_tokens[r]]` ([R, width], -1 beyond), and
    per position row the token it emits when it is reached (`row_tokens`, for logprobs)."""

    tokens: torch.Tensor
    num_tokens: torch.Tensor
    row_tokens: torch.Tensor


def verify(logits: torch.Tensor, meta: SamplingMetadata, layout: DraftLayout) -> Verified:
    """logits [rows, V] of every position row (with meta for those rows) -> the tokens gained.
    One host-to-device copy (pinned: it queues behind the forward) and no host sync."""
    device = logits.device
    indices = _Indices.of(layout, device)
    row_drafts = indices.row_drafts
    is_draft = row_drafts >= 0
    drafts_or_zero = row_drafts.clamp(min=0)
    greedy, probs = target_distribution(logits, meta)
    accepted = greedy == row_drafts
    emitted = greedy
    if probs is not None:
        uniform = _uniforms(probs.shape[0], meta, device)
        draft_prob = probs.gather(1, drafts_or_zero[:, None]).squeeze(1)
        random_accepted = uniform < draft_prob
        # The residual max(0, p - onehot(d)): p with the draft's entry removed (a bonus row keeps p).
        residual = probs.scatter(1, drafts_or_zero[:, None], 0.0)
        residual = torch.where(is_draft[:, None], residual, probs)
        random_emitted = exponential_race(residual, meta.generators)
        is_greedy = meta.temperature == 0.0
        accepted = torch.where(is_greedy, accepted, random_accepted)
        emitted = torch.where(is_greedy, greedy, random_emitted)
    accepted &= is_draft
    return _gather_per_request(accepted, emitted, indices)


@dataclass(slots=True)
class _Indices:
    """DraftLayout.host_indices on the device, unpacked."""

    row_drafts: torch.Tensor  # [rows]
    request_of_row: torch.Tensor  # [rows]
    first: torch.Tensor  # [R]
    index: torch.Tensor  # [R, width]
    valid: torch.Tensor  # [R, width] bool

    @classmethod
    def of(cls, layout: DraftLayout, device: torch.device) -> _Indices:
        rows, requests, width = layout.num_rows, len(layout.drafts), layout.width
        packed = to_device(layout.host_indices(), device)
        bounds = np.cumsum([0, rows, rows, requests, requests * width, requests * width])
        parts = [packed[bounds[k] : bounds[k + 1]] for k in range(5)]
        return cls(parts[0], parts[1], parts[2], parts[3].view(requests, width), parts[4].view(requests, width) != 0)


def _uniforms(num_rows: int, meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row; a seeded row draws it from its own generator (before its race noise),
    so its tokens repeat whatever the batch."""
    uniform = torch.rand(num_rows, device=device)
    for row, generator in meta.generators.items():
        uniform[row] = torch.rand((), generator=generator, device=device)
    return uniform


def _gather_per_request(accepted: torch.Tensor, emitted: torch.Tensor, indices: _Indices) -> Verified:
    """From position rows to requests: the leading run of accepted drafts, then the token the
    first unaccepted row emits. All on the device: no host sync."""
    device = accepted.device
    first, index, valid, row_drafts = indices.first, indices.index, indices.valid, indices.row_drafts
    offsets = torch.arange(index.shape[1], device=device)
    run = (accepted[index] & valid).to(torch.int32).cumprod(dim=1)
    num_accepted = run.sum(dim=1)  # the bonus row is never "accepted": at most len(drafts)
    stop_index = first + num_accepted
    tokens = torch.where(offsets[None, :] < num_accepted[:, None], row_drafts[index], -1)
    tokens.scatter_(1, num_accepted[:, None], emitted[stop_index][:, None])
    # Per row: its draft while it is inside the accepted run, else what it emits itself.
    in_run = torch.arange(accepted.shape[0], device=device) < (first + num_accepted)[indices.request_of_row]
    row_tokens = torch.where(in_run, row_drafts, emitted)
    return Verified(tokens=tokens, num_tokens=num_accepted + 1, row_tokens=row_tokens)
