"""The worker's batched logits processors against references on the same logits:
HF transformers' own processors (repetition penalty, min new tokens, bad words, sequence bias),
the OpenAI presence/frequency formula written out in torch, and log-softmax for logprobs.
Requests sit in a SamplingBatch the way the model runner keeps them, so row bookkeeping (rows
reused, tokens appended between steps) is part of what is checked."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from zllm.sampling_params import SamplingParams
from zllm.workers.sampler import apply_logits_processors, compute_logprobs, sample
from zllm.workers.sampling_batch import SamplingBatch

VOCAB = 64
CPU = torch.device("cpu")
EOS = 2


def logits_for(rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Both signs, so the repetition penalty's divide/multiply branches both run.
    return torch.randn(rows, VOCAB, generator=generator) * 4.0


def history(seed: int, prompt_len: int, output_len: int) -> tuple[list[int], list[int]]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 20, (prompt_len + output_len,), generator=generator).tolist()  # repeats likely
    return tokens[:prompt_len], tokens[prompt_len:]


class Batch:
    """A SamplingBatch holding requests as the runner does (token lists extended in place)."""

    def __init__(self, capacity: int = 4) -> None:
        self.batch = SamplingBatch(capacity, VOCAB, CPU)
        self.tokens: dict[str, list[int]] = {}

    def add(self, request_id: str, params: SamplingParams, prompt: list[int], output: list[int], bad_words=()) -> int:
        self.tokens[request_id] = prompt + output
        return self.batch.add(
            request_id, params, self.tokens[request_id], len(prompt), [EOS], [list(w) for w in bad_words]
        )

    def append(self, request_id: str, token_ids: list[int]) -> None:
        self.tokens[request_id].extend(token_ids)
        for token_id in token_ids:  # one per step, as the worker samples them
            self.batch.append_sampled([self.batch.rows[request_id]], [token_id])

    def processed(self, request_ids: list[str], logits: torch.Tensor) -> torch.Tensor:
        meta = self.batch.metadata([self.batch.rows[r] for r in request_ids])
        return apply_logits_processors(logits, meta)


def openai_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's definition: mu[j] -= c[j] * alpha_frequency + float(c[j] > 0) * alpha_presence."""
    out = logits.clone()
    for token, count in Counter(output).items():
        out[token] -= count * frequency + (1.0 if count > 0 else 0.0) * presence
    return out


# ---- penalties ----------------------------------------------------------------------------------


def test_repetition_penalty_matches_transformers_per_row_and_leaves_other_rows_alone():
    b = Batch()
    cases = {"plain": (1.0, 0), "mild": (1.2, 1), "strong": (2.0, 2), "reward": (0.7, 3)}
    histories = {}
    for request_id, (penalty, seed) in cases.items():
        histories[request_id] = history(seed, 6, 5)
        b.add(request_id, SamplingParams(repetition_penalty=penalty), *histories[request_id])
    order = ["mild", "plain", "reward", "strong"]  # not the order rows were given out in
    logits = logits_for(len(order))
    processed = b.processed(order, logits)
    for i, request_id in enumerate(order):
        prompt, output = histories[request_id]
        reference = RepetitionPenaltyLogitsProcessor(cases[request_id][0])(
            torch.tensor([prompt + output]), logits[i : i + 1].clone()
        )
        assert torch.equal(processed[i], reference[0]), request_id
    assert torch.equal(processed[1], logits[1])


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (1.5, -0.3), (-2.0, 2.0)])
def test_presence_and_frequency_penalties_match_the_openai_formula(presence, frequency):
    b = Batch()
    prompt, output = history(5, 4, 12)
    b.add("a", SamplingParams(presence_penalty=presence, frequency_penalty=frequency), prompt, output)
    b.add("untouched", SamplingParams(), *history(6, 4, 12))
    logits = logits_for(2, seed=1)
    processed = b.processed(["a", "untouched"], logits)
    torch.testing.assert_close(
        processed[0], openai_penalties(logits[0], output, presence, frequency), rtol=0, atol=1e-6
    )
    assert torch.equal(processed[1], logits[1])


def test_all_penalties_together_apply_repetition_then_frequency_and_presence():
    b = Batch()
    prompt, output = history(9, 5, 9)
    b.add("a", SamplingParams(repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3), prompt, output)
    logits = logits_for(1, seed=2)
    reference = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + output]), logits.clone())[0]
    reference = openai_penalties(reference, output, 0.4, 0.3)
    torch.testing.assert_close(b.processed(["a"], logits)[0], reference, rtol=0, atol=1e-6)


def test_penalty_counts_follow_appended_tokens_and_do_not_leak_into_a_reused_row():
    b = Batch(capacity=2)
    prompt, output = history(11, 3, 4)
    b.add("a", SamplingParams(frequency_penalty=1.0), prompt, output)
    b.append("a", [40, 40])
    b.append("a", [41])
    logits = logits_for(1, seed=3)
    expected = openai_penalties(logits[0], output + [40, 40, 41], 0.0, 1.0)
    torch.testing.assert_close(b.processed(["a"], logits)[0], expected, rtol=0, atol=1e-6)

    b.batch.remove("a")
    b.add("b", SamplingParams(frequency_penalty=1.0), [5, 6], [7])  # takes a's rows
    torch.testing.assert_close(
        b.processed(["b"], logits)[0], openai_penalties(logits[0], [7], 0.0, 1.0), rtol=0, atol=1e-6
    )


# ---- bans and bias ------------------------------------------------------------------------------


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_bans_stop_tokens_like_transformers_min_new_tokens(ignore_eos):
    b = Batch()
    stops = [9, 31]
    params = SamplingParams(min_tokens=3, stop_token_ids=stops, ignore_eos=ignore_eos)
    prompt = [5, 6, 7, 8]
    b.add("a", params, prompt, [])
    banned_ids = stops if ignore_eos else stops + [EOS]
    logits = logits_for(1, seed=4)
    for output_len in range(5):
        reference = MinNewTokensLengthLogitsProcessor(len(prompt), 3, banned_ids)(
            torch.tensor([prompt + [11] * output_len]), logits.clone()
        )
        assert torch.equal(b.processed(["a"], logits), reference), output_len
        b.append("a", [11])


def test_logit_bias_matches_transformers_sequence_bias_for_single_tokens():
    b = Batch()
    bias = {3: 5.0, 17: -100.0, 63: 0.25}
    b.add("a", SamplingParams(logit_bias=bias), [1, 2], [])
    b.add("none", SamplingParams(), [1, 2], [])
    b.add("other", SamplingParams(logit_bias={4: -1.5}), [1, 2], [])
    logits = logits_for(3, seed=5)
    processed = b.processed(["none", "a", "other"], logits)
    reference = SequenceBiasLogitsProcessor([[[t], v] for t, v in bias.items()])(
        torch.tensor([[1, 2]]), logits[1:2].clone()
    )
    torch.testing.assert_close(processed[1], reference[0], rtol=0, atol=1e-6)
    assert torch.equal(processed[0], logits[0])
    assert processed[2, 4] == logits[2, 4] - 1.5


def test_bad_words_match_transformers_no_bad_words_on_the_output():
    b = Batch()
    words = [[7], [12, 13], [20, 21, 22]]
    b.add("a", SamplingParams(bad_words=["x"]), [1, 2, 3], [], bad_words=words)
    logits = logits_for(1, seed=6)
    for output in ([], [12], [20, 21], [12, 20, 21], [5, 20]):
        reference = NoBadWordsLogitsProcessor(words, eos_token_id=EOS)(torch.tensor([[0] + output]), logits.clone())
        b.tokens["a"][3:] = []
        b.batch.remove("a")
        b.add("a", SamplingParams(bad_words=["x"]), [1, 2, 3], list(output), bad_words=words)
        assert torch.equal(b.processed(["a"], logits), reference), output


def test_greedy_picks_the_best_token_after_processing():
    b = Batch()
    b.add("a", SamplingParams(temperature=0.0, logit_bias={5: 100.0}), [1], [])
    b.add("b", SamplingParams(temperature=0.0), [1], [])
    logits = logits_for(2, seed=7)
    meta = b.batch.metadata([b.batch.rows["a"], b.batch.rows["b"]])
    assert sample(logits, meta).tolist() == [5, int(logits[1].argmax())]


def test_processors_do_not_modify_the_callers_logits():
    b = Batch()
    b.add("a", SamplingParams(repetition_penalty=2.0, logit_bias={1: 3.0}, min_tokens=1), *history(1, 3, 3))
    logits = logits_for(1)
    before = logits.clone()
    b.processed(["a"], logits)
    assert torch.equal(logits, before)


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_with_ranks_and_top_k():
    logits = logits_for(3, seed=8)
    chosen = torch.tensor([int(logits[0].argmax()), 10, int(logits[2].argsort(descending=True)[4])])
    result = compute_logprobs(logits, chosen, num_top=4)
    reference = torch.log_softmax(logits, dim=-1)
    for row in range(3):
        assert result.token_ids[row, 0] == chosen[row]
        torch.testing.assert_close(result.logprobs[row, 0], reference[row, chosen[row]])
        top = reference[row].topk(4)
        assert result.token_ids[row, 1:].tolist() == top.indices.tolist()
        torch.testing.assert_close(result.logprobs[row, 1:], top.values)
        assert result.ranks[row] == int((reference[row] > reference[row, chosen[row]]).sum()) + 1
    assert result.ranks[0] == 1 and result.ranks[2] == 5


def test_metadata_reports_the_largest_logprobs_request_of_the_batch():
    b = Batch()
    b.add("none", SamplingParams(), [1], [])
    b.add("two", SamplingParams(logprobs=2), [1], [])
    b.add("zero", SamplingParams(logprobs=0), [1], [])
    rows = b.batch.rows
    assert b.batch.metadata([rows["none"]]).max_num_logprobs is None
    assert b.batch.metadata([rows["none"], rows["zero"]]).max_num_logprobs == 0
    assert b.batch.metadata([rows["zero"], rows["two"], rows["none"]]).max_num_logprobs == 2


def test_rows_grow_past_the_initial_capacity():
    b = Batch(capacity=1)
    for i in range(5):
        b.add(f"r{i}", SamplingParams(temperature=0.5 + i, logit_bias={i: 1.0}), [1], [])
    meta = b.batch.metadata([b.batch.rows[f"r{i}"] for i in range(5)])
    assert meta.temperature.tolist() == [0.5, 1.5, 2.5, 3.5, 4.5]
    assert meta.logit_bias.token_ids.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "params, bad_words, field",
    [
        (SamplingParams(temperature=0.8), (), "top_k"),  # a sampled row: all_greedy False
        (SamplingParams(temperature=0.0, logit_bias={5: 1.0}), (), "logit_bias"),
        (SamplingParams(temperature=0.0, min_tokens=3), (), "banned"),
        (SamplingParams(temperature=0.0, logprobs=2), (), "max_num_logprobs"),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), (), "penalties"),
        (SamplingParams(temperature=0.0), ([9],), "banned"),  # a one-token bad word: always banned
    ],
)
def test_an_all_greedy_batch_skips_the_gathers_only_while_no_row_needs_them(params, bad_words, field):
    b = Batch()
    b.add("greedy", SamplingParams(temperature=0.0), [3, 4], [])
    plain = b.batch.metadata([b.batch.rows["greedy"]] * 3)
    assert plain.all_greedy and plain.temperature.tolist() == [0.0] * 3
    assert (plain.logit_bias, plain.banned, plain.penalties, plain.max_num_logprobs) == (None,) * 4
    b.add("special", params, [5, 6], [], bad_words=bad_words)
    rows = [b.batch.rows["greedy"], b.batch.rows["special"]]
    meta = b.batch.metadata(rows)
    if field == "top_k":
        assert not meta.all_greedy and meta.temperature.tolist() == pytest.approx([0.0, 0.8])
        assert meta.top_k is None  # top_k off in both rows
    else:
        assert getattr(meta, field) is not None
    b.batch.remove("special")  # its row goes to a plain greedy request: the gathers are skipped again
    b.add("greedy2", SamplingParams(temperature=0.0), [7], [])
    again = b.batch.metadata([b.batch.rows["greedy"], b.batch.rows["greedy2"]])
    assert again.all_greedy and (again.logit_bias, again.banned, again.penalties, again.max_num_logprobs) == (None,) * 4
