"""Batched sampling: logits processors, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

    raw logits ─┬─> logprobs (log-softmax of the raw logits: what the model thinks)
                └─> logit_bias, bans (min_tokens, bad_words), penalties ─> greedy | temperature,
                    top-k/top-p, min-p ─> exponential race

Every step works on whole-batch tensors; rows that do not use a feature are left untouched by
it (sparse updates or neutral values), so one request's settings cost the others nothing.
Random rows use the exponential race (argmax of probs / Exp(1) noise), which samples from probs
without a cumulative-sum search and without a host sync. A seeded request draws its noise from a
generator seeded by (seed, output index), so its tokens do not depend on batching or preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices over the seed space


@dataclass(slots=True)
class SparseLogits:
    """Entries (rows[i], token_ids[i]) of a [B, V] logits tensor; values None means -inf (a ban)."""

    rows: torch.Tensor  # [N] long
    token_ids: torch.Tensor  # [N] long
    values: torch.Tensor | None = None  # [N] float32


@dataclass(slots=True)
class Penalties:
    """Presence / frequency / repetition penalties of the batch rows that use them."""

    rows: torch.Tensor  # [P] long: which rows of the batch
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    output_counts: torch.Tensor  # [P, V] int32: occurrences of each token in the output so far
    prompt_mask: torch.Tensor  # [P, V] bool: tokens of the prompt


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] long; 0 = off
    top_p: torch.Tensor | None = None  # [B] float32; 1 = off
    min_p: torch.Tensor | None = None  # [B] float32; 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    logit_bias: SparseLogits | None = None
    banned: SparseLogits | None = None  # stop tokens before min_tokens, completions of bad words
    penalties: Penalties | None = None
    max_num_logprobs: int | None = None  # the largest SamplingParams.logprobs in the batch


@dataclass(slots=True)
class LogprobsTensors:
    """Per row: [chosen token, top-1..top-k] ids and logprobs, and the chosen token's rank."""

    token_ids: torch.Tensor  # [B, k + 1] long
    logprobs: torch.Tensor  # [B, k + 1] float32
    ranks: torch.Tensor  # [B] long


def seeded_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    mixed = (seed ^ ((output_index + 1) * _MIX)) & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(mixed)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    greedy, probs = target_distribution(logits, meta)
    if probs is None:
        return greedy
    sampled = exponential_race(probs, meta.generators)
    return torch.where(meta.temperature == 0.0, greedy, sampled)


def target_distribution(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What each row samples from: the greedy token [B], and the probabilities [B, V] after the
    processors, temperature, top-k/top-p and min-p (None when every row is greedy; a greedy
    row's probabilities are those at temperature 1, unused)."""
    if meta.all_greedy and meta.logit_bias is None and meta.banned is None and meta.penalties is None:
        return logits.argmax(dim=-1), None  # the raw logits' argmax: no float32 copy of [B, V]
    logits = apply_logits_processors(logits.to(torch.float32), meta)
    greedy = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy, None
    is_greedy = meta.temperature == 0.0
    temperature = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature)
    logits = logits / temperature[:, None]
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    if meta.min_p is not None:
        probs = apply_min_p(probs, meta.min_p)
    return greedy, probs


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Bias, bans and penalties, in vLLM's order (bias before penalties). Out of place: the
    caller's logits stay raw (logprobs are taken from them)."""
    if meta.logit_bias is not None:
        bias = meta.logit_bias
        logits = logits.index_put((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if meta.banned is not None:
        banned = meta.banned
        # NOTE: a device-side fill, not a host scalar tensor, which would cost a host-to-device copy.
        minus_inf = torch.full(banned.rows.shape, float("-inf"), dtype=logits.dtype, device=logits.device)
        logits = logits.index_put((banned.rows, banned.token_ids), minus_inf)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf unless bit t % 32 of bitmask[i, t // 32] is set
    (xgrammar's layout: int32 words [R, ceil(V / 32)]). A few batched ops on any device, inside
    no graph, with no host sync."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.to(torch.int32)[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Repetition (HF/CTRL: divide positive logits, multiply negative ones, for tokens seen in the
    prompt or output), then OpenAI's frequency and presence penalties over the output:
    logit -= frequency * count + presence * (count > 0)."""
    rows = logits[penalties.rows]
    counts = penalties.output_counts.to(rows.dtype)
    seen_in_output = penalties.output_counts > 0
    repetition = penalties.repetition[:, None]
    penalized = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows = torch.where(penalties.prompt_mask | seen_in_output, penalized, rows)
    rows = rows - penalties.frequency[:, None] * counts - penalties.presence[:, None] * seen_in_output.to(rows.dtype)
    return logits.index_copy(0, penalties.rows, rows)


def compute_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Log-softmax of the raw logits [B, V]; the chosen tokens [B] with their rank, and the top
    `num_top` of each row."""
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    chosen_logprobs = logprobs.gather(-1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([chosen[:, None], top_ids], dim=1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the top k, then outside the smallest set whose
    probability reaches top_p (the token that crosses p is kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        k = torch.where(top_k > 0, top_k, logits.shape[-1])
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before > top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero every probability below min_p times the row's largest."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from `probs` (unnormalised weights are fine): argmax of probs / Exp(1)."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
