"""CUDA graphs for pooling steps: the whole forward and the pooling of a packed step, replayed.

A pooling step (zllm/workers/pooling_runner.py) packs whole inputs back to back and attends
through FlashAttention's variable-length kernel, which reads the step's structure from a device
tensor (cu_seqlens) and one host int (the longest input, which sizes its grid). So a step has
static shapes once it is padded:

    tokens   N real rows -> T, a bucket of `pooling_graph_sizes` (at most a quarter more)
    inputs   S real ones -> seats(T) = min(T, max_num_seqs) + 1, the seats past S empty:
             cu_seqlens stops at N, so the kernel computes nothing for the padding rows (they
             keep whatever its output buffer held); they are pooled into seat S, which is dropped
    longest  L -> the smallest of `max_len_options(T)` >= L (steps of 4x): an upper bound on
             every input the kernel sees, as it requires

One graph is captured per (T, max_len), largest first, into one memory pool. Everything the
step varies lives in static buffers: token ids, positions, token types, cu_seqlens, each row's
seat (mean pooling's index_add_ target), the row each input's vector is read from (CLS, last
token, a classifier head's input) and each input's length. Padding rows hold token 0 at position
0: every op but attention is row-wise, and attention reads only the real inputs' rows, each
input its own, so no real row sees them, whatever values they come to hold.

`EagerPoolingSteps` runs the same padded steps without graphs, so the padding is tested on CPU.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from zllm.workers.graph_capture import GraphCapturer
from zllm.workers.models.bert import PackedInputs
from zllm.workers.transfer import to_device

logger = logging.getLogger(__name__)

# Past this a step's GEMMs dwarf its launches (and a graph pool would hold its activations for
# good): larger steps run eagerly.
_LARGEST_GRAPH_TOKENS = 16384
_MAX_LEN_STEP = 4  # the kernel's grid grows with max_len: a bucket at most 4x the longest input
_SMALLEST_MAX_LEN = 64
# The kernel launches (max_len / 128) x seats x heads blocks, most of which find no rows when a
# step is padded; a (tokens, max_len) graph whose (max_len / 128) x seats passes this is not
# captured (a step with inputs that long runs eagerly, where its own longest sizes the grid).
# A bound on the graph count and on wasted blocks, not a measured optimum.
_MAX_GRID_ROWS = 32768
_GRID_BLOCK = 128


def pooling_graph_sizes(max_num_batched_tokens: int, largest: int = _LARGEST_GRAPH_TOKENS) -> list[int]:
    """Padded token counts to capture, up to the step budget (or `largest`): powers of two to
    128, then four steps per doubling, so a step pads by at most a quarter of its size."""
    cap = min(max_num_batched_tokens, largest)
    sizes = [16, 32, 64, 128]
    while sizes[-1] < cap:
        last = sizes[-1]
        sizes.append(last + (1 << (last.bit_length() - 3)))
    return [s for s in sizes if s < cap] + [cap]


def max_len_options(tokens: int, max_model_len: int) -> list[int]:
    """The longest-input bounds captured for a bucket of `tokens` rows: 64, 256, 1024, ... below
    the most an input can be there (min(tokens, max_model_len)), and that most itself."""
    most = min(tokens, max_model_len)
    options, bound = [], _SMALLEST_MAX_LEN
    while bound < most:
        options.append(bound)
        bound *= _MAX_LEN_STEP
    return [*options, most]


class PaddedLayout(NamedTuple):
    """A step's structure at a graph's sizes (host arrays)."""

    cu_seqlens: np.ndarray  # [seats + 1]: the real inputs, then empty seats (N repeated)
    segment: np.ndarray  # [tokens]: each row's seat (padding rows: seat S, dropped)
    pick: np.ndarray  # [seats]: the row each input's vector is read from (0 for the empty seats)
    counts: np.ndarray  # [seats]: each input's length (1 where there is none: no 0 / 0)


def padded_layout(lengths: np.ndarray, tokens: int, seats: int, reads_last: bool) -> PaddedLayout:
    """The layout of inputs of `lengths` (S of them, N rows) padded to `tokens` rows and `seats`
    inputs (seats > S, tokens >= N). reads_last: the vector is the last row's, else the first's."""
    count, real = len(lengths), int(lengths.sum())
    assert seats > count and tokens >= real, (seats, count, tokens, real)
    ends = np.cumsum(lengths)
    cu_seqlens = np.concatenate(([0], ends, np.full(seats - count, real))).astype(np.int64)
    sizes = np.append(lengths, tokens - real)
    segment = np.repeat(np.arange(count + 1), sizes)
    pick = np.zeros(seats, dtype=np.int64)
    pick[:count] = ends - 1 if reads_last else ends - lengths
    counts = np.ones(seats, dtype=np.int64)
    counts[:count] = lengths
    return PaddedLayout(cu_seqlens, segment, pick, counts)


class EagerPoolingSteps:
    """A pooling model's padded steps over static buffers, run eagerly: what PoolingGraphs captures."""

    def __init__(
        self, model, pooling_type: str, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
    ) -> None:
        self.model = model
        # What the step's vectors read: the pooling type, or where there is a classifier head its
        # input (the first row for BERT, the last for a decoder, ModernBERT's mean or first).
        self.pooling_type = model.head_pooling if model.head is not None else pooling_type
        self.max_num_seqs = max_num_seqs
        self.sizes = pooling_graph_sizes(max_num_batched_tokens)
        self.keys = [(t, m) for t in self.sizes for m in self._max_lens(t, max_model_len)]
        self.reads_last = self.pooling_type == "last"
        device = next(model.parameters()).device
        largest, seats = self.sizes[-1], self.seats(self.sizes[-1])
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.token_types = torch.zeros(largest, dtype=torch.long, device=device)
        self.segment = torch.zeros(largest, dtype=torch.long, device=device)
        self.cu_seqlens = torch.zeros(seats + 1, dtype=torch.int32, device=device)
        self.pick = torch.zeros(seats, dtype=torch.long, device=device)
        self.counts = torch.ones(seats, dtype=torch.float32, device=device)
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def seats(self, tokens: int) -> int:
        """Inputs a graph of `tokens` rows holds: every input the scheduler may send (at most
        max_num_seqs, at most one per row) and the seat the padding rows pool into."""
        return min(tokens, self.max_num_seqs) + 1

    def _max_lens(self, tokens: int, max_model_len: int) -> list[int]:
        """max_len_options(tokens) whose grid stays under _MAX_GRID_ROWS (the smallest always)."""
        options = max_len_options(tokens, max_model_len)
        seats = self.seats(tokens)
        return [m for i, m in enumerate(options) if i == 0 or -(-m // _GRID_BLOCK) * seats <= _MAX_GRID_ROWS]

    def key(self, num_tokens: int, longest: int, inputs: int) -> tuple[int, int] | None:
        """The (tokens, max_len) graph for a step, or None: too large a step or too long an input."""
        fits = ((t, m) for t, m in self.keys if t >= num_tokens and m >= longest and self.seats(t) > inputs)
        return next(fits, None)

    def run(
        self, token_ids: np.ndarray, positions: np.ndarray, token_types: np.ndarray, lengths: np.ndarray
    ) -> torch.Tensor | None:
        """The step's pooled vectors [inputs, width] float32, or None where no graph fits. The
        rows are the graph's output, which the next step rewrites: the caller copies them."""
        key = self.key(len(token_ids), int(lengths.max()), len(lengths))
        if key is None:
            return None
        self._fill(key, token_ids, positions, token_types, lengths)
        self._replay(key)
        return self.outputs[key][: len(lengths)]

    def _fill(
        self,
        key: tuple[int, int],
        token_ids: np.ndarray,
        positions: np.ndarray,
        token_types: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        """The step's arrays, padded to the graph's sizes, into the static buffers: one host-to-device
        copy (no sync), then copies on the device."""
        tokens, seats = key[0], self.seats(key[0])
        layout = padded_layout(lengths, tokens, seats, self.reads_last)
        pad = np.zeros(tokens - len(token_ids), dtype=np.int64)
        parts = [np.concatenate((a.astype(np.int64, copy=False), pad)) for a in (token_ids, positions, token_types)]
        host = np.concatenate([*parts, *layout])
        staged = to_device(host, self.input_ids.device)
        targets = (self.input_ids, self.positions, self.token_types, self.cu_seqlens, self.segment, self.pick)
        sizes = (tokens, tokens, tokens, seats + 1, tokens, seats)
        first = 0
        for target, size in zip(targets, sizes):
            target[:size].copy_(staged[first : first + size])
            first += size
        self.counts[:seats].copy_(staged[first : first + seats])

    def _replay(self, key: tuple[int, int]) -> None:
        self.outputs[key] = self._forward(key)

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        """The padded forward and pooling at `key`'s sizes, from the static buffers."""
        tokens, max_len = key
        seats = self.seats(tokens)
        packed = PackedInputs(self.cu_seqlens[: seats + 1], max_len)
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], self.token_types[:tokens], packed)
        return self._pooled(hidden, tokens, seats)

    def _pooled(self, hidden: torch.Tensor, tokens: int, seats: int) -> torch.Tensor:
        """[seats, width] float32: what the eager runner's _pooled gives, one row per seat."""
        rows = self._pooled_rows(hidden, tokens, seats)
        if self.model.head is None:
            return rows
        return self.model.head(rows.to(hidden.dtype)).float()

    def _pooled_rows(self, hidden: torch.Tensor, tokens: int, seats: int) -> torch.Tensor:
        if self.pooling_type in ("cls", "last"):
            return hidden[self.pick[:seats]].float()
        # Mean pooling sums in fp32 (as the eager path): padding rows land in seat S, dropped.
        sums = torch.zeros(seats, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, self.segment[:tokens], hidden.float())
        return sums / self.counts[:seats, None]


class PoolingGraphs(EagerPoolingSteps):
    """EagerPoolingSteps with every (tokens, max_len) step captured as a CUDA graph."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capturer = GraphCapturer()

    def capture(self) -> None:
        started = time.perf_counter()
        for key in reversed(self.keys):  # largest first: the smaller graphs reuse its memory pool
            empty = np.zeros(0, dtype=np.int64)  # every row padding, every seat empty
            self._fill(key, empty, empty, empty, empty)
            self.graphs[key], self.outputs[key] = self.capturer.capture(partial(self._forward, key))
        torch.cuda.synchronize()
        logger.info(
            "captured %d pooling CUDA graphs (steps of %d to %d tokens) in %.1f s",
            len(self.keys),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - started,
        )

    def _replay(self, key: tuple[int, int]) -> None:
        self.graphs[key].replay()
