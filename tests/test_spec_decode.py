"""Speculative decoding: the n-gram proposer, the rejection sampler's exactness (greedy token for
token, and a chi-square test of the sampled distribution that a wrong sampler fails), and the
real engine on SmolLM2-135M-Instruct (fp32, CPU) with each served method, whose greedy output
must equal decoding without speculation."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zllm import LLM, SamplingParams
from zllm.config import EngineConfig, SpeculativeConfig
from zllm.workers.sampler import SamplingMetadata
from zllm.workers.spec_decode import rejection_sampler
from zllm.workers.spec_decode.ngram import NgramProposer, propose_ngram
from zllm.workers.spec_decode.rejection_sampler import DraftLayout, verify

# ---- the n-gram proposer -----------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # suffix (6, 7): seen at 1 and 6; the latest (6) was followed by 2, 3, 6
    assert propose_ngram(tokens, 1, 3, 3) == [2, 3, 6]
    # a longer suffix wins over a later short one: (1, 2) matches only at 0
    tokens = np.array([1, 2, 40, 41, 2, 50, 1, 2])
    assert propose_ngram(tokens, 1, 2, 2) == [40, 41]
    assert propose_ngram(tokens, 1, 1, 2) == [50, 1]  # n = 1: the latest 2 was followed by 50, 1


def test_ngram_proposes_nothing_without_a_match_and_stops_at_the_end():
    assert propose_ngram(np.array([1, 2, 3, 4]), 1, 3, 3) == []
    assert propose_ngram(np.array([7]), 1, 3, 3) == []
    assert propose_ngram(np.array([1, 2, 1]), 1, 3, 5) == [2, 1]  # only what exists after the match
    assert propose_ngram(np.array([3, 3, 3, 3]), 2, 2, 4) == [3]


def _ngram_by_brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition, written out: the longest n first, then the latest earlier window."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_lookup_equals_the_brute_force_definition_on_random_tokens():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        min_n = int(rng.integers(1, 4))
        max_n, k = min_n + int(rng.integers(0, 4)), int(rng.integers(1, 6))
        assert propose_ngram(np.asarray(tokens), min_n, max_n, k) == _ngram_by_brute_force(tokens, min_n, max_n, k)


def test_ngram_proposer_keeps_its_copy_of_the_tokens_current():
    proposer = NgramProposer(1, 3, 4)
    state = SimpleNamespace(request_id="a", token_ids=[1, 2, 3, 1, 2])
    assert proposer.propose([state], [state]) == {"a": [3, 1, 2]}
    state.token_ids.extend([9, 8, 1, 2] * 40)  # past the copy's first size: it grows
    assert proposer.propose([state], [state]) == {"a": _ngram_by_brute_force(state.token_ids, 1, 3, 4)}
    again = SimpleNamespace(request_id="a", token_ids=[5, 6, 5])  # the same id, a new request
    assert proposer.propose([again], [again]) == {"a": [6, 5]}
    proposer.forget("a")
    assert proposer.propose([state], [state]) == {"a": _ngram_by_brute_force(state.token_ids, 1, 3, 4)}


def test_adaptive_ngram_drafts_follow_what_each_request_kept():
    """ZLLM_NGRAM_ADAPTIVE: k at first; one more than was kept after a partly rejected draft;
    doubling up to k while whole drafts are kept. Requests keep their own lengths."""
    period = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    proposer = NgramProposer(1, 3, 8, adaptive=True)
    copy = SimpleNamespace(request_id="copy", token_ids=period * 3)  # a periodic text: every draft kept
    chat = SimpleNamespace(request_id="chat", token_ids=[5, 6, 7, 9, 5, 6])
    assert proposer.propose([copy, chat], [copy, chat]) == {"copy": [1, 2, 3, 4, 5, 6, 7, 8], "chat": [7, 9, 5, 6]}
    copy.token_ids += [1, 2, 3, 4, 5, 6, 7, 8, 9]  # all 8 kept and the bonus token: stays at 8
    chat.token_ids += [7, 5]  # kept "7", then the target's own token: drafts of at most 2 now
    assert proposer.propose([copy, chat], [copy, chat]) == {"copy": [1, 2, 3, 4, 5, 6, 7, 8], "chat": [6, 7]}
    chat.token_ids += [6, 7, 9]  # the whole short draft kept: the cap doubles to 4
    assert proposer.propose([chat], [chat]) == {"chat": [5, 6, 7, 5]}
    chat.token_ids += [5]  # one token back, matching: the draft was not (all) scored, the cap stays
    proposer.propose([chat], [chat])
    assert proposer._last["chat"][0] == 4
    drafted = proposer._last["chat"][1]
    chat.token_ids += [drafted[0] + 1000]  # the target's own token at the first position: nothing kept
    proposer.propose([chat], [chat])
    assert proposer._last["chat"][0] == 1
    proposer.forget("chat")
    assert "chat" not in proposer._last
    fixed = NgramProposer(1, 3, 8)  # off: every draft as long as the lookup finds, rejected or not
    other = SimpleNamespace(request_id="other", token_ids=[5, 6, 7, 9, 5, 6])
    assert fixed.propose([other], [other]) == {"other": [7, 9, 5, 6]}
    other.token_ids += [7, 5]
    assert fixed.propose([other], [other]) == {"other": [6, 7, 5]}  # adaptive would stop at 2


# ---- the rejection sampler ---------------------------------------------------------------------


def test_host_indices_of_a_few_requests_equal_the_numpy_build(monkeypatch):
    rng = np.random.default_rng(1)
    for _ in range(300):
        drafts = [rng.integers(0, 50, int(rng.integers(0, 6))).tolist() for _ in range(int(rng.integers(1, 10)))]
        layout = DraftLayout.of(drafts)
        by_lists = layout.host_indices()
        monkeypatch.setattr(rejection_sampler, "_FEW_REQUESTS", 0)
        assert by_lists.tolist() == layout.host_indices().tolist()
        monkeypatch.undo()


def _meta(temperature: float, rows: int) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.full((rows,), temperature), all_greedy=temperature == 0.0)


def test_greedy_rows_keep_the_drafts_up_to_the_first_non_argmax_then_take_the_argmax():
    vocab = 10
    argmax = [[3, 4, 5, 6], [1, 2], [7]]  # per request: argmax at each of its position rows
    drafts = [[3, 4, 9], [2], []]  # request 0: two accepted then a miss; 1: a miss at once; 2: none
    logits = torch.zeros((sum(len(d) + 1 for d in drafts), vocab))
    rows = [token for request in argmax for token in request[: len(drafts[argmax.index(request)]) + 1]]
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    layout = DraftLayout.of(drafts)
    out = verify(logits, _meta(0.0, layout.num_rows), layout)
    assert out.num_tokens.tolist() == [3, 1, 1]
    assert out.tokens.tolist() == [[3, 4, 5, -1], [1, -1, -1, -1], [7, -1, -1, -1]]


def _first_two_tokens(logits: torch.Tensor, drafts: list[int], samples: int, seed: int) -> np.ndarray:
    """Sample `samples` times from a fixed two-position target (logits [2, V]: the first token's
    distribution, then the second's after drafts[0]) with the given drafts; returns each
    sample's (first token, second token or -1)."""
    torch.manual_seed(seed)
    layout = DraftLayout.of([drafts] * samples)
    per_request = logits[: len(drafts) + 1]
    out = verify(per_request.repeat(samples, 1), _meta(1.0, layout.num_rows), layout)
    return out.tokens[:, :2].numpy()


# Chi-square critical values at p = 0.001 (a false alarm once in a thousand runs), by degrees of freedom.
_CHI2_CRITICAL_0_001 = {5: 20.52, 6: 22.46, 7: 24.32}


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [0, 5, 7])  # a likely draft, a rare one, the least likely
def test_sampling_with_a_draft_draws_from_the_targets_distribution(draft):
    vocab = 8
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn((2, vocab), generator=generator) * 1.5
    first = np.bincount(_first_two_tokens(logits, [draft], 40_000, seed=2)[:, 0], minlength=vocab)
    target = logits[0].softmax(-1).double().numpy()
    assert _chi_square(first, target) < _CHI2_CRITICAL_0_001[vocab - 1]


def test_a_wrong_rejection_rule_fails_the_same_chi_square_test(monkeypatch):
    """The test has teeth: a sampler that draws the replacement from p itself (not from the
    residual without the rejected draft) over-weights the draft, and is caught."""
    vocab, draft = 8, 0
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn((2, vocab), generator=generator) * 1.5
    target = logits[0].softmax(-1).double().numpy()
    real_race = rejection_sampler.exponential_race

    def race_over_p(probs, generators):  # ignores the residual: the classic bug
        return real_race(logits[0].softmax(-1).expand_as(probs).contiguous(), generators)

    monkeypatch.setattr(rejection_sampler, "exponential_race", race_over_p)
    first = np.bincount(_first_two_tokens(logits, [draft], 40_000, seed=2)[:, 0], minlength=vocab)
    assert _chi_square(first, target) > _CHI2_CRITICAL_0_001[vocab - 1]


def test_the_token_after_an_accepted_draft_follows_the_targets_next_distribution():
    vocab, draft = 8, 2
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn((2, vocab), generator=generator)
    pairs = _first_two_tokens(logits, [draft], 40_000, seed=4)
    second = pairs[pairs[:, 0] == draft, 1]  # the draft was accepted: the bonus row sampled the next
    counts = np.bincount(second, minlength=vocab)
    assert counts.sum() > 1000
    assert _chi_square(counts, logits[1].softmax(-1).double().numpy()) < _CHI2_CRITICAL_0_001[vocab - 1]


# ---- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "medusa"}, "speculative_config.method: must be one of"),
        ({"method": "eagle3"}, "speculative_config.model: is required with method 'eagle3'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens: must be 1..16"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "speculative_config.model: is required"),
        ({"method": "ngram", "lookahead": 2}, "unknown key(s) lookahead"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size: must be >= 1"),
    ],
)
def test_bad_speculative_configs_are_refused_at_start(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig.create(None, device="cpu", speculative_config=config)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from tests.helpers.models import save_tiny_llama

    draft = save_tiny_llama(tmp_path / "draft", vocab_size=300)
    with pytest.raises(ValueError, match="draft's vocabulary \\(300 tokens\\) differs from the target's"):
        EngineConfig.create(None, device="cpu", speculative_config={"method": "draft_model", "model": str(draft)})


def test_speculation_takes_async_scheduling_as_resolved():
    config = EngineConfig.create(None, device="cpu", speculative_config={"num_speculative_tokens": 2})
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert config.async_scheduling is False  # off on CPU, as without drafts
    config = EngineConfig.create(None, device="cpu", async_scheduling=True, speculative_config={})
    assert config.async_scheduling is True


def test_the_cli_takes_vllms_json():
    import argparse

    from zllm.launch.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine_kwargs(args)["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "[1, 2]"])


# ---- the engine, on the real SmolLM2-135M-Instruct weights (fp32, CPU) --------------------------

ENGINE = dict(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=96)
COPY_HEAVY = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Count from 1 to 25, separated by commas: 1, 2, 3, 4, 5,",
    "Fix the spelling and repeat the text: Teh shop opnes at nine and closses at six every day.",
]
CHAT = ["Write a short poem about the sea."]
PROMPTS = COPY_HEAVY + CHAT
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def _tokens(llm: LLM, prompts, params) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


class Baseline:
    """Decoding without speculation, each (prompts, params) computed once for the module."""

    def __init__(self) -> None:
        self.llm = LLM(**ENGINE)
        self.engine = self.llm.engine
        self._memo: dict[tuple, list] = {}

    def tokens(self, prompts, params) -> list[list[list[int]]]:
        key = (tuple(prompts), repr(params))
        if key not in self._memo:
            self._memo[key] = _tokens(self.llm, prompts, params)
        return self._memo[key]

    def generate(self, prompts, params):
        return self.llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def baseline():
    base = Baseline()
    yield base
    base.llm.shutdown()


@pytest.fixture(scope="module")
def ngram():
    llm = LLM(**ENGINE, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    yield llm
    llm.shutdown()


@pytest.mark.slow
def test_ngram_greedy_output_equals_decoding_without_speculation(baseline, ngram):
    assert _tokens(ngram, PROMPTS, GREEDY) == baseline.tokens(PROMPTS, GREEDY)
    stats = ngram.engine.core.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens


@pytest.mark.slow
def test_draft_model_greedy_output_equals_decoding_without_speculation(baseline):
    """SmolLM2 drafting for itself: correctness never depends on the draft being good, but this
    one is the target, so nearly every draft is accepted."""
    model_dir = baseline.engine.config.model
    draft = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 4}
    with LLM(**ENGINE, speculative_config=draft) as llm:
        assert _tokens(llm, PROMPTS, GREEDY) == baseline.tokens(PROMPTS, GREEDY)
        stats = llm.engine.core.stats()
    assert stats.spec_decode_acceptance_rate > 0.8
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) == 4  # never more drafts than k


@pytest.mark.slow
def test_greedy_equality_holds_with_chunked_prefill_and_preemption(baseline):
    """A 24-token budget splits every prompt into chunks; 8 blocks of 16 tokens cannot hold three
    requests at once, so requests are preempted and recomputed (their drafts dropped)."""
    small = dict(ENGINE, num_kv_blocks=8, max_num_batched_tokens=24)
    draft = {"method": "draft_model", "model": baseline.engine.config.model, "num_speculative_tokens": 3}
    expected = baseline.tokens(COPY_HEAVY, GREEDY)
    for config in ({"method": "ngram", "num_speculative_tokens": 3}, draft):
        with LLM(**small, speculative_config=config) as llm:
            assert _tokens(llm, COPY_HEAVY, GREEDY) == expected
            assert llm.engine.core.stats().num_preemptions > 0


@pytest.mark.slow
def test_sampling_features_keep_working_with_drafts(baseline, ngram):
    """Penalties, min_tokens, bad words, stop strings, logprobs and n = 2 see the accepted drafts
    as output, position by position: greedy results equal those without speculation."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20, presence_penalty=0.5, bad_words=["fox", " 7"]),
        SamplingParams(temperature=0.0, max_tokens=32, stop=["lazy"], n=2),
    ]
    for p in params:
        assert _tokens(ngram, COPY_HEAVY, p) == baseline.tokens(COPY_HEAVY, p), p
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)
    spec = ngram.generate(COPY_HEAVY, with_logprobs, use_tqdm=False)
    plain = baseline.generate(COPY_HEAVY, with_logprobs)
    for a, b in zip(spec, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        for row_a, row_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert row_a.keys() == row_b.keys()
            for token in row_a:
                assert row_a[token].logprob == pytest.approx(row_b[token].logprob, abs=1e-4)
                assert row_a[token].rank == row_b[token].rank


@pytest.mark.slow
def test_seeded_sampling_with_drafts_repeats_exactly(ngram):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=1234)
    first = _tokens(ngram, COPY_HEAVY, params)
    assert _tokens(ngram, COPY_HEAVY[::-1], params)[::-1] == first  # another batch order
    assert all(len(c[0]) > 0 for c in first)


@pytest.mark.slow
def test_structured_outputs_with_drafts_checked_and_masked_per_position(baseline):
    """SmolLM2 drafting for itself under grammars: drafts the grammar forbids are dropped, each
    position row is masked by what the grammar allows after the drafts before it, and greedy
    output equals decoding without speculation (and follows the grammar)."""
    import json

    from zllm.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    cases = [
        StructuredOutputsParams(json=schema),
        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{4}"),
    ]
    prompts = ["Describe a person called Ann, aged 31, as JSON.", "Is the sea blue?", "Give a code:"]
    draft = {"method": "draft_model", "model": baseline.engine.config.model, "num_speculative_tokens": 3}
    with LLM(**ENGINE, speculative_config=draft) as llm:
        for prompt, constraint in zip(prompts, cases):
            params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
            spec = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            plain = baseline.generate([prompt], params)[0].outputs[0]
            assert spec.token_ids == plain.token_ids, constraint
            if constraint.json is not None:
                assert set(json.loads(spec.text)) == {"name", "age"}
        stats = llm.engine.core.stats()
    assert stats.spec_decode_num_accepted_tokens > 5  # the constrained requests did take drafts
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) <= 3


@pytest.mark.slow
def test_async_drafts_beside_a_constrained_request(baseline):
    """Async scheduling with n-gram drafts: the constrained request goes without drafts (its
    grammar could not check worker-proposed ones), the others draft; greedy output is unchanged."""
    from zllm.sampling_params import StructuredOutputsParams

    prompts = COPY_HEAVY[:2] + ["Is the sea blue?"]
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    params = [SamplingParams(temperature=0.0, max_tokens=24)] * 2
    params.append(SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=choice))
    expected = [o.outputs[0].token_ids for o in baseline.generate(prompts, params)]
    with LLM(**ENGINE, async_scheduling=True, speculative_config={"num_speculative_tokens": 3}) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        assert llm.engine.core.stats().spec_decode_num_accepted_tokens > 0


@pytest.mark.slow
def test_ngram_at_tensor_parallel_2_equals_tp_1(baseline):
    expected = baseline.tokens(COPY_HEAVY, GREEDY)
    with LLM(**ENGINE, tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 3}) as llm:
        assert _tokens(llm, COPY_HEAVY, GREEDY) == expected
        assert llm.engine.core.stats().spec_decode_num_accepted_tokens > 0


def test_stats_merge_and_metrics_of_speculation():
    from zllm.frontend.engine_calls import merge_engine_stats
    from zllm.frontend.metrics import _accepted_per_position

    one = {"spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 6}
    two = {"spec_decode_num_drafts": 6, "spec_decode_num_draft_tokens": 8, "spec_decode_num_accepted_tokens": 2}
    one["spec_decode_num_accepted_tokens_per_pos"], two["spec_decode_num_accepted_tokens_per_pos"] = [4, 2], [1, 1]
    merged = merge_engine_stats({0: one, 1: two})
    assert merged["spec_decode_acceptance_rate"] == pytest.approx(8 / 20)
    assert merged["spec_decode_mean_acceptance_length"] == pytest.approx(1 + 8 / 10)
    assert merged["spec_decode_num_accepted_tokens_per_pos"] == [5, 3]
    (family,) = _accepted_per_position("m", merged["engines"])
    assert [(s.labels["dp_rank"], s.labels["position"], s.value) for s in family.samples] == [
        ("0", "0", 4.0),
        ("0", "1", 2.0),
        ("1", "0", 1.0),
        ("1", "1", 1.0),
    ]


# ---- async scheduling with drafts (tiny random Llamas, fp32, CPU) -------------------------------
#
# The workers propose the drafts of steps the core scheduled ahead; each step is scheduled as if
# every draft in flight were accepted, and rolled back when its answer comes. These checks use
# tiny random checkpoints made by transformers (fast enough for many engines and samples).

TINY_ENGINE = dict(device="cpu", dtype="float32", max_model_len=256)
# Repeats for n-gram to find; the random model's own continuations repeat as well.
TINY_PROMPTS = [
    [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5],
    [9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11, 12, 9, 10, 11, 12, 9],
    [20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 20, 30, 40, 50, 60],
    [7, 7, 8, 7, 7, 8, 7, 7],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama target and a one-layer draft with its vocabulary (other weights)."""
    from tests.helpers.models import save_tiny_llama

    root = tmp_path_factory.mktemp("spec_async")
    return save_tiny_llama(root / "target"), save_tiny_llama(root / "draft", num_hidden_layers=1)


def _tiny_tokens(model, prompts, params, **engine) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), **{**TINY_ENGINE, **engine})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], llm


TINY_GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_expected(tiny):
    """Greedy tokens without speculation, synchronous steps."""
    return _tiny_tokens(tiny[0], TINY_PROMPTS, TINY_GREEDY, async_scheduling=False)[0]


@pytest.mark.parametrize("method", ["ngram", "draft_self", "draft_other"])
def test_async_scheduling_with_drafts_keeps_greedy_output_chunked_and_preempted(tiny, tiny_expected, method):
    """Async steps with drafts under a 24-token budget (chunked prefill) and 10 blocks for four
    requests of up to 4 blocks (preemption): greedy tokens equal decoding without drafts, and
    every block is free again at the end (rejected drafts' slots are reused, none leaks)."""
    target, other = tiny
    config = {"method": "ngram", "num_speculative_tokens": 4}
    if method != "ngram":
        config = {"method": "draft_model", "model": str(target if method == "draft_self" else other)}
        config["num_speculative_tokens"] = 3
    engine = dict(async_scheduling=True, num_kv_blocks=10, max_num_batched_tokens=24, speculative_config=config)
    llm = LLM(str(target), **{**TINY_ENGINE, **engine})
    try:
        assert llm.engine.config.async_scheduling is True
        outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], TINY_GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == tiny_expected
        stats = llm.engine.core.stats()
        assert stats.num_preemptions > 0
        assert stats.spec_decode_num_draft_tokens > 0
        assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
        if method != "draft_other":
            assert stats.spec_decode_num_accepted_tokens > 0
        assert llm.engine.core.num_free_kv_blocks() == llm.engine.core.num_kv_blocks
    finally:
        llm.shutdown()


def test_async_drafts_at_tensor_parallel_2(tiny, tiny_expected):
    """Two worker processes (gloo): each rank proposes the same n-gram drafts from the tokens it
    holds, and the core's async steps come back in order (FlushStep when none follows)."""
    config = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(tiny[0]), **TINY_ENGINE, tensor_parallel_size=2, async_scheduling=True, speculative_config=config)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], TINY_GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == tiny_expected
        assert llm.engine.core.stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_turn_off_per_step_at_disable_by_batch_size(tiny, tiny_expected, async_scheduling):
    """disable_by_batch_size 2: steps while two or more requests run go without drafts, and
    once the shorter requests finish the last one drafts again. Output stays exact."""
    llm = LLM(
        str(tiny[0]),
        **TINY_ENGINE,
        async_scheduling=async_scheduling,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2},
    )
    steps: list[tuple[int, bool]] = []  # (requests scheduled, with drafts)
    executor = llm.engine.core.executor
    submit = executor.submit_step

    def recording_submit(step):
        steps.append((len(step.scheduled_ids), bool(step.spec_token_ids)))
        submit(step)

    executor.submit_step = recording_submit
    try:
        lengths = [40, 8, 16, 24]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in TINY_PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [t[:n] for t, n in zip(tiny_expected, lengths)]
    finally:
        llm.shutdown()
    assert not any(drafts for num_scheduled, drafts in steps if num_scheduled >= 2)
    assert any(drafts for _, drafts in steps)  # the longest request, alone at the end


def _two_sample_chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic that two count vectors come from one distribution, over the
    categories with at least 10 samples in all (the rest pooled); returns (statistic, dof)."""
    keep = (a + b) >= 10
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    if a[-1] + b[-1] == 0:
        a, b = a[:-1], b[:-1]
    total = a + b
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    statistic = float((((a - expected_a) ** 2) / expected_a).sum() + (((b - expected_b) ** 2) / expected_b).sum())
    return statistic, len(a) - 1


# p = 0.001 critical values of chi-square by degrees of freedom (scipy.stats.chi2.ppf(0.999, dof)).
_CHI2_CRITICAL_0_001_BY_DOF = {
    8: 26.12,
    9: 27.88,
    10: 29.59,
    11: 31.26,
    12: 32.91,
    13: 34.53,
    14: 36.12,
    15: 37.70,
    16: 39.25,
    17: 40.79,
    18: 42.31,
    19: 43.82,
    20: 45.31,
    21: 46.80,
    22: 48.27,
    23: 49.73,
}


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    from tests.helpers.models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("spec_vocab") / "m", vocab_size=24)


SAMPLES = 3000
VOCAB = 24
# Each token but 0-2 is followed by the next; 33 tokens, so that every request after the first
# finds 32 of them in the prefix cache and the 3000 prefills cost little.
VOCAB_PROMPT = list(range(3, VOCAB)) + list(range(3, 15))


def _sampled_steps(model, **engine) -> tuple[np.ndarray, LLM]:
    """SAMPLES continuations of 4 tokens at temperature 1 (unseeded); returns each one's steps
    (t3 - t2, t4 - t3) mod VOCAB: n-gram drafts t + 1 after t here, so a sampler that favours
    drafts shows up in the count of 1s (the marginals alone would hide it). Under async
    scheduling t2's step leaves before t1's answer (which says the request has drafts), so
    drafts are scored from t3 on."""
    llm = LLM(str(model), **TINY_ENGINE, max_num_seqs=256, max_num_batched_tokens=4096, max_waiting=SAMPLES, **engine)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": VOCAB_PROMPT}] * SAMPLES, params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = np.asarray([o.outputs[0].token_ids for o in outs])
    return np.diff(tokens[:, 1:], axis=1) % VOCAB, llm


NGRAM_ASYNC = dict(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def plain_steps(small_vocab):
    torch.manual_seed(0)
    return _sampled_steps(small_vocab, async_scheduling=False)[0]


_CHI2_CRITICAL_0_001_DOF_1 = 10.83


def _fits_plain(plain: np.ndarray, spec: np.ndarray) -> list[bool]:
    """Per position (token 3, token 4): whether the spec samples pass, against the plain ones,
    both the chi-square test over every step value and the one over "the step was the draft's"
    (1) against the rest, whose single degree of freedom a bias towards drafts cannot hide in."""
    fits = []
    for position in (0, 1):
        a, b = (np.bincount(x[:, position], minlength=VOCAB) for x in (plain, spec))
        statistic, dof = _two_sample_chi_square(a, b)
        drafted, _ = _two_sample_chi_square(np.asarray([a[1], a.sum() - a[1]]), np.asarray([b[1], b.sum() - b[1]]))
        fits.append(statistic < _CHI2_CRITICAL_0_001_BY_DOF[dof] and drafted < _CHI2_CRITICAL_0_001_DOF_1)
    return fits


def test_async_sampling_with_drafts_draws_the_targets_distribution(small_vocab, plain_steps):
    """Thousands of samples with async steps and n-gram drafts against as many without
    speculation: the 3rd and 4th tokens (decided by verification) pass a chi-square test of one
    distribution."""
    spec, llm = _sampled_steps(small_vocab, **NGRAM_ASYNC)
    stats = llm.engine.core.stats()
    assert stats.spec_decode_num_draft_tokens > SAMPLES // 2  # most requests had a draft scored
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert _fits_plain(plain_steps, spec) == [True, True]


def test_a_wrong_rejection_rule_fails_the_engines_chi_square_test(small_vocab, plain_steps, monkeypatch):
    """The same test has teeth: drawing a rejected draft's replacement from p itself (the
    draft's probability put back into the residual) is caught."""
    real_race = rejection_sampler.exponential_race

    def race_over_p(residual, generators):
        missing = 1.0 - residual.sum(dim=-1, keepdim=True)  # the rejected draft's p; 0 for a bonus row
        return real_race(torch.where(residual == 0, missing, residual), generators)

    monkeypatch.setattr(rejection_sampler, "exponential_race", race_over_p)
    spec, _ = _sampled_steps(small_vocab, **NGRAM_ASYNC)
    assert _fits_plain(plain_steps, spec)[0] is False
