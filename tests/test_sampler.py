"""The batched sampler: greedy, seeded determinism, top-k / top-p / min-p filtering, and the
empirical distribution of sampled tokens. Every test fixes its seeds, so every run is identical."""

from __future__ import annotations

import math

import pytest
import torch

from zllm.workers.sampler import SamplingMetadata, apply_min_p, apply_top_k_top_p, sample, seeded_generator

CPU = torch.device("cpu")
VOCAB = 1000

# A hand-made distribution, deliberately not sorted by probability, so that the sort/scatter in the
# filters is exercised: by rank the probabilities are 0.5, 0.3, 0.15, 0.05.
HAND_PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
RANK = [1, 3, 0, 2]  # token ids from the most to the least likely


# ---- helpers ----------------------------------------------------------------------------------


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 3.0


def hand_logits(rows: int = 1) -> torch.Tensor:
    return HAND_PROBS.log().expand(rows, -1).clone()


def make_meta(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    min_p: list[float] | None = None,
    seeds: dict[int, tuple[int, int]] | None = None,
) -> SamplingMetadata:
    """seeds: row -> (seed, output_index)."""
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        all_greedy=all(t == 0.0 for t in temperature),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.long),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators={row: seeded_generator(seed, index, CPU) for row, (seed, index) in (seeds or {}).items()},
    )


def kept_ids(filtered_logits: torch.Tensor) -> list[set[int]]:
    """Per row, the token ids a logit filter left available (finite logits)."""
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in filtered_logits]


def nonzero_ids(filtered_probs: torch.Tensor) -> list[set[int]]:
    """Per row, the token ids a probability filter left available (non-zero probabilities)."""
    return [set(torch.nonzero(row).flatten().tolist()) for row in filtered_probs]


def seeded_tokens(
    logits_row: torch.Tensor,
    seed: int,
    num_steps: int,
    batch_others: torch.Tensor | None = None,
    row: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[int]:
    """The tokens one seeded request draws at output indices 0..num_steps-1, placed at `row` of a
    batch whose other rows are `batch_others` (unseeded, different settings)."""
    tokens = []
    for step in range(num_steps):
        others = [] if batch_others is None else list(batch_others)
        rows = others[:row] + [logits_row] + others[row:]
        n = len(rows)
        temps = [0.7 + 0.3 * (i % 3) for i in range(n)]
        ks = [(i * 7) % 50 for i in range(n)]
        ps = [0.5 + 0.1 * (i % 5) for i in range(n)]
        temps[row], ks[row], ps[row] = temperature, top_k, top_p
        meta = make_meta(temps, top_k=ks, top_p=ps, seeds={row: (seed, step)})
        tokens.append(sample(torch.stack(rows), meta)[row].item())
    return tokens


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    total = counts.sum().item()
    expected = expected_probs * total
    support = expected_probs > 0
    return (((counts - expected) ** 2)[support] / expected[support]).sum().item()


# Upper 0.1% points of the chi-square distribution, by degrees of freedom.
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def draw_many(
    logits_row: torch.Tensor,
    draws: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 0,
) -> torch.Tensor:
    """Token counts over `draws` unseeded draws from one distribution (one batched call)."""
    torch.manual_seed(seed)
    logits = logits_row.expand(draws, -1).clone()
    meta = make_meta([temperature] * draws, top_k=[top_k] * draws, top_p=[top_p] * draws, min_p=[min_p] * draws)
    tokens = sample(logits, meta)
    return torch.bincount(tokens, minlength=logits_row.shape[-1]).to(torch.float64)


# ---- greedy -----------------------------------------------------------------------------------


def test_all_greedy_equals_argmax():
    logits = random_logits(8)
    meta = make_meta([0.0] * 8)
    assert meta.all_greedy
    assert torch.equal(sample(logits, meta), logits.argmax(dim=-1))


def test_greedy_rows_equal_argmax_on_the_general_path():
    # all_greedy=False forces the temperature / filter / race path; greedy rows must still be argmax.
    logits = random_logits(6)
    meta = make_meta([0.0] * 6, top_k=[3] * 6, top_p=[0.5] * 6, min_p=[0.2] * 6)
    meta.all_greedy = False
    assert torch.equal(sample(logits, meta), logits.argmax(dim=-1))


def test_greedy_accepts_half_precision_logits():
    logits = random_logits(4).to(torch.bfloat16)
    assert torch.equal(sample(logits, make_meta([0.0] * 4)), logits.float().argmax(dim=-1))


def test_top_k_1_is_greedy_even_at_high_temperature():
    logits = random_logits(16)
    torch.manual_seed(1)
    for _ in range(20):
        meta = make_meta([10.0] * 16, top_k=[1] * 16)
        assert torch.equal(sample(logits, meta), logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = random_logits(6, vocab=50)
    temperature = [0.0, 1.5, 0.0, 2.0, 1.0, 0.0]
    greedy_rows = [0, 2, 5]
    argmax = logits.argmax(dim=-1)
    torch.manual_seed(2)
    sampled_values: set[int] = set()
    for trial in range(60):
        meta = make_meta(
            temperature,
            top_k=[0, 0, 5, 0, 10, 1],
            top_p=[1.0, 0.9, 0.3, 1.0, 1.0, 0.5],
            min_p=[0.0, 0.0, 0.5, 0.01, 0.0, 0.0],
            seeds={1: (7, trial)},
        )
        tokens = sample(logits, meta)
        assert torch.equal(tokens[greedy_rows], argmax[greedy_rows])
        sampled_values.add(tokens[3].item())
    assert len(sampled_values) > 5  # the sampling rows do sample (temperature 2 over 50 tokens)


# ---- seeds ------------------------------------------------------------------------------------


def test_seeded_request_repeats_across_runs_and_global_rng_state():
    logits_row = random_logits(1, seed=3)[0]
    torch.manual_seed(100)
    first = seeded_tokens(logits_row, seed=1234, num_steps=30, temperature=1.3)
    torch.manual_seed(200)  # the global RNG must not matter for a seeded row
    torch.rand(17)
    second = seeded_tokens(logits_row, seed=1234, num_steps=30, temperature=1.3)
    assert first == second
    assert len(set(first)) > 5  # it really samples


def test_seeded_request_does_not_depend_on_its_batch():
    logits_row = random_logits(1, seed=4)[0]
    others = random_logits(5, seed=5)
    alone = seeded_tokens(logits_row, seed=99, num_steps=25, temperature=0.9, top_p=0.95)
    torch.manual_seed(1)
    first_row = seeded_tokens(
        logits_row, seed=99, num_steps=25, batch_others=others[:2], row=0, temperature=0.9, top_p=0.95
    )
    torch.manual_seed(2)
    middle_row = seeded_tokens(
        logits_row, seed=99, num_steps=25, batch_others=others, row=3, temperature=0.9, top_p=0.95
    )
    assert alone == first_row == middle_row


def test_other_seed_gives_other_tokens():
    logits_row = random_logits(1, seed=6)[0]
    a = seeded_tokens(logits_row, seed=1, num_steps=30, temperature=1.5)
    b = seeded_tokens(logits_row, seed=2, num_steps=30, temperature=1.5)
    assert a != b


def test_output_index_changes_the_draw():
    # Near-uniform logits over 64 tokens: consecutive output indices of one seed must not repeat the
    # same draw; over 640 indices every token shows up and no token dominates.
    vocab, steps = 64, 640
    logits_row = torch.zeros(vocab)
    tokens = seeded_tokens(logits_row, seed=42, num_steps=steps)
    repeats = sum(a == b for a, b in zip(tokens, tokens[1:]))
    assert repeats < steps * 4 / vocab  # ~1/64 expected by chance
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    assert (counts > 0).all()
    assert counts.max() < 4 * steps / vocab
    # The generators themselves differ by index.
    noise = [torch.empty(8).exponential_(generator=seeded_generator(42, i, CPU)) for i in range(3)]
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[1], noise[2])
    same = torch.empty(8).exponential_(generator=seeded_generator(42, 1, CPU))
    assert torch.equal(noise[1], same)


def test_large_seeds_are_accepted():
    # SamplingParams allows seeds up to 2**64 - 1.
    for seed in (0, 2**63 - 1, 2**63, 2**64 - 1):
        seeded_generator(seed, 0, CPU)
        seeded_generator(seed, 10**9, CPU)


# ---- filters on a hand-made distribution --------------------------------------------------------


def top_ids(n: int) -> set[int]:
    return set(RANK[:n])


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.3, 1), (0.45, 1), (0.6, 2), (0.79, 2), (0.81, 3), (0.9, 3), (0.96, 4), (1.0, 4)],
)
def test_top_p_keeps_smallest_prefix_reaching_p(top_p, expected):
    # Exact boundaries (0.5, 0.8, 0.95) are left out: there 0.5 + 0.3 == 0.8 etc. is a float tie
    # that the rounding of the softmax decides.
    filtered = apply_top_k_top_p(hand_logits(), None, torch.tensor([top_p]))
    assert kept_ids(filtered) == [top_ids(expected)]


@pytest.mark.parametrize(("top_k", "expected"), [(1, 1), (2, 2), (3, 3), (4, 4), (0, 4), (100, 4)])
def test_top_k_keeps_k_most_likely(top_k, expected):
    filtered = apply_top_k_top_p(hand_logits(), torch.tensor([top_k]), None)
    assert kept_ids(filtered) == [top_ids(expected)]


@pytest.mark.parametrize(
    ("top_k", "top_p", "expected"),
    [
        (2, 1.0, 2),
        (3, 0.6, 2),
        (2, 0.6, 1),  # top-p applies to the top-k renormalized: 0.5/0.8 = 0.625 >= 0.6
        (3, 0.9, 3),  # renormalized 0.526, 0.316: two reach only 0.842
        (3, 0.8, 2),  # 0.842 >= 0.8
        (0, 0.6, 2),
    ],
)
def test_top_k_and_top_p_together(top_k, top_p, expected):
    filtered = apply_top_k_top_p(hand_logits(), torch.tensor([top_k]), torch.tensor([top_p]))
    assert kept_ids(filtered) == [top_ids(expected)]


def test_top_k_top_p_per_row_and_kept_logits_unchanged():
    logits = hand_logits(4)
    top_k = torch.tensor([0, 1, 3, 0])
    top_p = torch.tensor([0.6, 1.0, 1.0, 1.0])
    filtered = apply_top_k_top_p(logits, top_k, top_p)
    assert kept_ids(filtered) == [top_ids(2), top_ids(1), top_ids(3), top_ids(4)]
    kept = torch.isfinite(filtered)
    assert torch.equal(filtered[kept], logits[kept])
    assert (filtered[~kept] == float("-inf")).all()


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.0, 4), (0.05, 4), (0.2, 3), (0.35, 2), (0.5, 2), (0.7, 1), (1.0, 1)],
)
def test_min_p_keeps_tokens_at_least_min_p_times_max(min_p, expected):
    probs = HAND_PROBS[None, :].clone()
    filtered = apply_min_p(probs, torch.tensor([min_p]))
    assert nonzero_ids(filtered) == [top_ids(expected)]
    kept = filtered > 0
    assert torch.equal(filtered[kept], probs[kept])  # not renormalized here; the race does not need it


def test_min_p_rule_on_random_rows():
    probs = random_logits(8, vocab=200).softmax(dim=-1)
    min_p = torch.linspace(0.0, 0.9, 8)
    filtered = apply_min_p(probs, min_p)
    for row in range(8):
        threshold = probs[row].max() * min_p[row]
        expected = set(torch.nonzero(probs[row] >= threshold).flatten().tolist())
        assert nonzero_ids(filtered[row : row + 1]) == [expected]


# ---- sampled frequencies ----------------------------------------------------------------------


def renormalized(probs: torch.Tensor, keep: set[int]) -> torch.Tensor:
    out = torch.zeros_like(probs, dtype=torch.float64)
    for i in keep:
        out[i] = probs[i]
    return out / out.sum()


DIST6 = torch.tensor([0.06, 0.25, 0.02, 0.32, 0.2, 0.15])  # ranked: 3, 1, 4, 5, 0, 2


@pytest.mark.parametrize(
    ("name", "kwargs", "keep"),
    [
        ("plain", {}, {0, 1, 2, 3, 4, 5}),
        ("top_k=3", {"top_k": 3}, {3, 1, 4}),
        ("top_p=0.7", {"top_p": 0.7}, {3, 1, 4}),  # 0.32 + 0.25 = 0.57 < 0.7
        ("min_p=0.5", {"min_p": 0.5}, {3, 1, 4}),  # >= 0.16
        ("top_k=4,top_p=0.75", {"top_k": 4, "top_p": 0.75}, {3, 1, 4}),  # 0.57/0.92 = 0.62 < 0.75
        ("min_p=0.3", {"min_p": 0.3}, {3, 1, 4, 5}),  # >= 0.096
    ],
)
def test_sampled_frequencies_match_filtered_distribution(name, kwargs, keep):
    draws = 20_000
    counts = draw_many(DIST6.log(), draws, seed=11, **kwargs)
    drawn = set(torch.nonzero(counts).flatten().tolist())
    assert drawn == keep, name  # only kept tokens, and every kept token shows up
    expected = renormalized(DIST6, keep)
    assert chi_square(counts, expected) < CHI2_CRITICAL_0_001[len(keep) - 1], name


def test_temperature_reshapes_the_distribution():
    draws = 20_000
    for temperature in (0.5, 2.0):
        counts = draw_many(DIST6.log(), draws, temperature=temperature, seed=12)
        expected = DIST6.double() ** (1.0 / temperature)
        expected /= expected.sum()
        assert chi_square(counts, expected) < CHI2_CRITICAL_0_001[5], temperature


def test_seeded_draws_follow_the_distribution():
    # Each row carries its own seeded generator (one request at 3000 output indices): the
    # per-index seeding must not bias the draws.
    draws = 3000
    logits = DIST6.log().expand(draws, -1).clone()
    meta = make_meta([1.0] * draws, seeds={row: (2024, row) for row in range(draws)})
    counts = torch.bincount(sample(logits, meta), minlength=6).double()
    assert chi_square(counts, DIST6.double()) < CHI2_CRITICAL_0_001[5]


def test_frequency_check_is_sensitive():
    # Guard for the tests above: the same statistic rejects a clearly wrong distribution.
    counts = draw_many(DIST6.log(), 20_000, seed=13)
    uniform = torch.full((6,), 1 / 6, dtype=torch.float64)
    assert chi_square(counts, uniform) > 100 * CHI2_CRITICAL_0_001[5]
    assert math.isfinite(chi_square(counts, DIST6.double()))
