"""The sampling side of the persistent batch: each live request owns a row of preallocated
tensors holding its sampling settings, written once when the request arrives and updated
incrementally as its tokens come in. A step gathers the rows it samples with one index per
tensor, instead of rebuilding settings from every request's SamplingParams.

    row:          0     1     2    ...        (a request keeps its row until it leaves)
    temperature  0.0   0.7   1.0
    min_tokens    0     5     0
    stop_ids    [2,-1] [2,7] [-1,-1]          (-1 pads; masked while output < min_tokens)
    bias ids    [-1]   [17]  [-1]   values [0] [-5.0] [0]

Penalties keep [rows, vocab] state (output token counts, prompt token mask) on the device, only
for the requests that use them; each step's sampled tokens are added to the counts in one batched
update.
"""

from __future__ import annotations

import torch

from zllm.sampling_params import SamplingParams
from zllm.workers.sampler import Penalties, SamplingMetadata, SparseLogits, seeded_generator
from zllm.workers.transfer import to_device

_PAD = -1

# Columns of the per-row tables.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)
_TOP_K, _MIN_TOKENS, _NUM_LOGPROBS, _NUM_OUTPUT, _PENALTY_ROW, _HAS_SEED, _HAS_BAD_WORDS = range(7)


class PaddedRows:
    """A [rows, width] CPU tensor of per-row variable-length lists, padded with -1 (or 0)."""

    def __init__(self, capacity: int, dtype: torch.dtype, pad: float) -> None:
        self.pad = pad
        self.data = torch.full((capacity, 0), pad, dtype=dtype)

    def set(self, row: int, values: list) -> None:
        if len(values) > self.data.shape[1]:
            extra = torch.full((self.data.shape[0], len(values) - self.data.shape[1]), self.pad, dtype=self.data.dtype)
            self.data = torch.cat([self.data, extra], dim=1)
        self.data[row].fill_(self.pad)
        if values:
            self.data[row, : len(values)] = torch.tensor(values, dtype=self.data.dtype)

    def grow(self, capacity: int) -> None:
        extra = torch.full((capacity - self.data.shape[0], self.data.shape[1]), self.pad, dtype=self.data.dtype)
        self.data = torch.cat([self.data, extra])


class PenaltyState:
    """Output token counts and prompt masks [rows, vocab] for the requests with penalties."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[int, int] = {}  # batch row -> penalty row
        self.free: list[int] = []
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._pending_rows: list[int] = []  # tokens appended since the last step, applied at once
        self._pending_tokens: list[int] = []

    def add(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> int:
        """Start counting for a batch row; returns its penalty row."""
        if not self.free:
            self._grow()
        prow = self.free.pop()
        self.rows[row] = prow
        self.counts[prow].zero_()
        self.prompt_mask[prow].zero_()
        self.prompt_mask[prow, to_device(prompt_ids, self.device, torch.long)] = True
        self.append(row, output_ids)
        return prow

    def remove(self, row: int) -> None:
        prow = self.rows.pop(row, None)
        if prow is not None:
            self._flush()  # pending tokens of this row must not land on its next owner
            self.free.append(prow)

    def append(self, row: int, token_ids: list[int]) -> None:
        prow = self.rows.get(row)
        if prow is not None and token_ids:
            self._pending_rows.extend([prow] * len(token_ids))
            self._pending_tokens.extend(token_ids)

    def gather(
        self, penalty_rows: torch.Tensor, floats: torch.Tensor, drafted: list[list[int]] | None = None
    ) -> Penalties | None:
        """Penalties of the batch positions whose penalty row (-1: none) is set; `floats` are the
        batch's settings; `drafted`: tokens counted as output on top of each position's own."""
        (positions,) = (penalty_rows >= 0).nonzero(as_tuple=True)
        if positions.numel() == 0:
            return None
        self._flush()
        prows = to_device(penalty_rows[positions], self.device)
        chosen = to_device(floats[positions], self.device)
        counts = self.counts[prows]  # a copy: the drafts' counts are this step's alone
        if drafted is not None:
            extra = [(i, t) for i, p in enumerate(positions.tolist()) for t in drafted[p]]
            if extra:
                where = to_device([i for i, _ in extra], self.device, torch.long)
                tokens = to_device([t for _, t in extra], self.device, torch.long)
                counts.index_put_((where, tokens), torch.ones_like(where, dtype=torch.int32), accumulate=True)
        return Penalties(
            rows=to_device(positions, self.device),
            presence=chosen[:, _PRESENCE],
            frequency=chosen[:, _FREQUENCY],
            repetition=chosen[:, _REPETITION],
            output_counts=counts,
            prompt_mask=self.prompt_mask[prows],
        )

    def _flush(self) -> None:
        if self._pending_rows:
            rows = to_device(self._pending_rows, self.device, torch.long)
            tokens = to_device(self._pending_tokens, self.device, torch.long)
            self.counts.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.int32), accumulate=True)
            self._pending_rows, self._pending_tokens = [], []

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(4, 2 * old)
        self.counts = torch.cat(
            [self.counts, torch.zeros((new - old, self.vocab_size), dtype=torch.int32, device=self.device)]
        )
        self.prompt_mask = torch.cat(
            [self.prompt_mask, torch.zeros((new - old, self.vocab_size), dtype=torch.bool, device=self.device)]
        )
        self.free.extend(range(new - 1, old - 1, -1))


class SamplingBatch:
    """Rows of sampling settings for the requests the worker holds."""

    def __init__(self, capacity: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.rows: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._floats = torch.zeros((capacity, 6), dtype=torch.float32)
        self._ints = torch.zeros((capacity, 7), dtype=torch.long)
        self._stop_ids = PaddedRows(capacity, torch.long, _PAD)  # banned while output < min_tokens
        self._bias_ids = PaddedRows(capacity, torch.long, _PAD)
        self._bias_values = PaddedRows(capacity, torch.float32, 0.0)
        self._seeds: dict[int, int] = {}
        self._bad_words: dict[int, tuple[list[list[int]], list[int], int]] = {}  # row -> words, tokens, prompt_len
        self._penalties = PenaltyState(vocab_size, device)
        # Rows that need more than an argmax: while none of these is live, a step's metadata is
        # built without a torch op on the host (the common all-greedy batch).
        self._sampled_rows: set[int] = set()  # temperature > 0
        self._special_rows: set[int] = set()  # logit bias, stop tokens before min_tokens, logprobs
        self._zeros = torch.zeros(0, dtype=torch.float32, device=device)  # the temperatures of an all-greedy batch

    # ---- requests in and out ------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        sampling: SamplingParams,
        token_ids: list[int],
        prompt_len: int,
        eos_token_ids: list[int],
        bad_words_token_ids: list[list[int]],
    ) -> int:
        """Give the request a row; `token_ids` is the list the runner keeps extending in place."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.rows[request_id] = row
        s = sampling
        self._floats[row] = torch.tensor(
            [s.temperature, s.top_p, s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty]
        )
        num_logprobs = -1 if s.logprobs is None else s.logprobs
        penalty_row = (
            self._penalties.add(row, token_ids[:prompt_len], token_ids[prompt_len:]) if s.has_penalties else -1
        )
        self._ints[row] = torch.tensor(
            [
                s.top_k,
                s.min_tokens,
                num_logprobs,
                len(token_ids) - prompt_len,
                penalty_row,
                s.seed is not None,
                bool(bad_words_token_ids),
            ]
        )
        stop_ids = list(s.stop_token_ids or []) + ([] if s.ignore_eos else list(eos_token_ids))
        self._stop_ids.set(row, stop_ids if s.min_tokens > 0 else [])
        self._bias_ids.set(row, list((s.logit_bias or {}).keys()))
        self._bias_values.set(row, list((s.logit_bias or {}).values()))
        if s.seed is not None:
            self._seeds[row] = s.seed
        if s.temperature != 0.0:
            self._sampled_rows.add(row)
        if s.logit_bias or (s.min_tokens > 0 and stop_ids) or s.logprobs is not None:
            self._special_rows.add(row)
        if bad_words_token_ids:
            self._bad_words[row] = (bad_words_token_ids, token_ids, prompt_len)
        return row

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        self._seeds.pop(row, None)
        self._sampled_rows.discard(row)
        self._special_rows.discard(row)
        self._bad_words.pop(row, None)
        self._penalties.remove(row)
        self._free.append(row)

    def append_sampled(self, rows: list[int], token_ids: list[int]) -> None:
        """One sampled token for each entry of `rows` (a row may repeat: a request that gained
        several tokens): one indexed add for the whole batch (a torch call per row costs ~10 us;
        at 256 rows that is a few ms of every step)."""
        if not rows:
            return
        index = torch.tensor(rows)
        self._ints[:, _NUM_OUTPUT].index_add_(0, index, torch.ones_like(index))
        if self._penalties.rows:
            for row, token_id in zip(rows, token_ids):
                self._penalties.append(row, [token_id])

    def clear(self) -> None:
        for request_id in list(self.rows):
            self.remove(request_id)

    # ---- one step ------------------------------------------------------------------------------

    def metadata(self, rows: list[int], drafted: list[list[int]] | None = None) -> SamplingMetadata:
        """The settings of `rows` (a row may repeat). `drafted`, for speculative decoding: per
        entry, the draft tokens that come before its position, as if they were already output
        (they count for min_tokens, penalties, bad words and the seeded output index)."""
        if not (self._sampled_rows or self._special_rows or self._bad_words or self._penalties.rows):
            return SamplingMetadata(temperature=self._greedy_temperatures(len(rows)), all_greedy=True)
        index = torch.tensor(rows, dtype=torch.long)
        floats, ints = self._floats[index], self._ints[index]
        if drafted is not None:
            ints[:, _NUM_OUTPUT] += torch.tensor([len(d) for d in drafted], dtype=torch.long)
        temperature, num_logprobs = floats[:, _TEMPERATURE], ints[:, _NUM_LOGPROBS]
        meta = SamplingMetadata(
            temperature=to_device(temperature, self.device),
            all_greedy=bool((temperature == 0.0).all()),
            logit_bias=self._logit_bias(index),
            banned=self._banned(rows, index, ints, drafted),
            penalties=self._penalties.gather(ints[:, _PENALTY_ROW], floats, drafted),
            max_num_logprobs=int(num_logprobs.max()) if bool((num_logprobs >= 0).any()) else None,
        )
        if not meta.all_greedy:
            meta.top_k = self._unless_all(ints[:, _TOP_K], 0)
            meta.top_p = self._unless_all(floats[:, _TOP_P], 1.0)
            meta.min_p = self._unless_all(floats[:, _MIN_P], 0.0)
            meta.generators = self._generators(rows, ints)
        return meta

    def _greedy_temperatures(self, num_rows: int) -> torch.Tensor:
        """Zeros on the device: a slice of one buffer, no copy from the host."""
        if self._zeros.shape[0] < num_rows:
            self._zeros = torch.zeros(max(num_rows, 2 * self._zeros.shape[0]), dtype=torch.float32, device=self.device)
        return self._zeros[:num_rows]

    def _unless_all(self, values: torch.Tensor, off: float) -> torch.Tensor | None:
        return None if bool((values == off).all()) else to_device(values, self.device)

    def _generators(self, rows: list[int], ints: torch.Tensor) -> dict[int, torch.Generator]:
        """Seeded rows draw from a generator seeded by (seed, output index)."""
        (positions,) = ints[:, _HAS_SEED].nonzero(as_tuple=True)
        return {
            p: seeded_generator(self._seeds[rows[p]], int(ints[p, _NUM_OUTPUT]), self.device)
            for p in positions.tolist()
        }

    def _logit_bias(self, index: torch.Tensor) -> SparseLogits | None:
        ids = self._bias_ids.data[index]
        positions, columns = (ids != _PAD).nonzero(as_tuple=True)
        if positions.numel() == 0:
            return None
        return SparseLogits(
            rows=to_device(positions, self.device),
            token_ids=to_device(ids[positions, columns], self.device),
            values=to_device(self._bias_values.data[index][positions, columns], self.device),
        )

    def _banned(
        self, rows: list[int], index: torch.Tensor, ints: torch.Tensor, drafted: list[list[int]] | None = None
    ) -> SparseLogits | None:
        """Stop tokens of the rows still short of min_tokens, and each bad word's last token where
        the output ends with the word's other tokens."""
        ids = self._stop_ids.data[index]
        active = (ids != _PAD) & (ints[:, _NUM_OUTPUT] < ints[:, _MIN_TOKENS])[:, None]
        positions, columns = active.nonzero(as_tuple=True)
        ban_rows, ban_ids = positions.tolist(), ids[positions, columns].tolist()
        # Bad words need a look at each such request's last tokens: only their rows are visited.
        for position in ints[:, _HAS_BAD_WORDS].nonzero(as_tuple=True)[0].tolist():
            extra = drafted[position] if drafted is not None else []
            for token_id in self._bad_word_completions(rows[position], extra):
                ban_rows.append(position)
                ban_ids.append(token_id)
        if not ban_rows:
            return None
        return SparseLogits(
            rows=to_device(ban_rows, self.device, torch.long), token_ids=to_device(ban_ids, self.device, torch.long)
        )

    def _bad_word_completions(self, row: int, drafted: list[int]) -> list[int]:
        words, token_ids, prompt_len = self._bad_words[row]
        output = token_ids[prompt_len:] + drafted
        banned = []
        for word in words:
            prefix = word[:-1]
            if len(prefix) <= len(output) and (not prefix or output[len(output) - len(prefix) :] == prefix):
                banned.append(word[-1])
        return banned

    def _grow(self) -> None:
        old = self._floats.shape[0]
        new = max(4, 2 * old)
        self._floats = torch.cat([self._floats, torch.zeros((new - old, self._floats.shape[1]))])
        self._ints = torch.cat([self._ints, torch.zeros((new - old, self._ints.shape[1]), dtype=torch.long)])
        for padded in (self._stop_ids, self._bias_ids, self._bias_values):
            padded.grow(new)
        self._free.extend(range(new - 1, old - 1, -1))
