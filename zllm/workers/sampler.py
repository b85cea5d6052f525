"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Random rows use the exponential race (argmax of probs / Exp(1) noise), which samples from probs
without a cumulative-sum search and without a host sync. A seeded request draws its noise from a
generator seeded by (seed, output index), so its tokens do not depend on batching or preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads consecutive indices over the seed space


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 means greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] long; 0 = off
    top_p: torch.Tensor | None = None  # [B] float32; 1 = off
    min_p: torch.Tensor | None = None  # [B] float32; 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator


def seeded_generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    mixed = (seed ^ ((output_index + 1) * _MIX)) & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(mixed)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logits [B, V] -> token ids [B]."""
    logits = logits.to(torch.float32)
    greedy = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy
    is_greedy = meta.temperature == 0.0
    temperature = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature)
    logits = logits / temperature[:, None]
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    if meta.min_p is not None:
        probs = apply_min_p(probs, meta.min_p)
    sampled = _exponential_race(probs, meta.generators)
    return torch.where(is_greedy, greedy, sampled)


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


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)
