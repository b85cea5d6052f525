"""Prefix caching, preemption, priorities, n > 1, logprobs and penalties through the real engine
(SmolLM2-135M-Instruct, fp32, CPU), checked against HF transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from tests.helpers.models import hf_greedy
from zllm import LLM, LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a careful assistant for a small bookshop. You answer questions about opening hours, "
    "orders, shipping and returns in two sentences at most. The shop opens at nine and closes at six, "
    "ships within two days, and accepts returns within thirty days with a receipt."
)
QUESTIONS = [
    "When do you open?",
    "Can I return a book without a receipt?",
    "How fast do you ship?",
    "Do you sell e-books?",
    "Are you open on Sunday?",
    "What is your phone number?",
]
ENGINE = dict(dtype="float32", max_model_len=512, num_kv_blocks=128)


def chat_prompts(tokenizer, questions: list[str]) -> list[dict]:
    prompts = []
    for question in questions:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
    return prompts


def token_ids(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def greedy(max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, **ENGINE)


@pytest.fixture(scope="module")
def prompts(llm) -> list[dict]:
    return chat_prompts(llm.get_tokenizer(), QUESTIONS)


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts) -> list[list[int]]:
    """Greedy tokens with prefix caching off and a KV cache large enough for everything at once."""
    uncached = LLM(smollm2_dir, enable_prefix_caching=False, **ENGINE)
    tokens = token_ids(uncached.generate(prompts, greedy(), use_tqdm=False))
    assert uncached.engine.core.stats().prefix_cache_queries == 0
    del uncached
    return tokens


# ---- prefix caching ------------------------------------------------------------------------------


def test_prefix_caching_gives_the_same_greedy_tokens_and_reports_its_hits(llm, prompts, reference):
    llm.reset_prefix_cache()
    before = llm.engine.core.stats()
    first = llm.generate(prompts, greedy(), use_tqdm=False)  # requests after the first share the system prompt
    again = llm.generate(prompts, greedy(), use_tqdm=False)  # every prompt is cached but its last block
    assert token_ids(first) == reference
    assert token_ids(again) == reference
    stats = llm.engine.core.stats()
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    system_blocks = 16 * (len(llm.get_tokenizer().encode(SYSTEM)) // 16)
    assert hits >= (2 * len(prompts) - 1) * (system_blocks - 16)
    assert 0.5 < hits / queries < 1.0 and stats.prefix_cache_hit_rate > 0
    assert all(o.num_cached_tokens >= system_blocks - 16 for o in again)


def test_a_cache_salt_keeps_prefixes_apart(llm, prompts, reference):
    llm.generate(prompts[:1], greedy(), use_tqdm=False)
    salted = [{**p, "cache_salt": "tenant-b"} for p in prompts[:2]]
    outputs = llm.generate(salted, greedy(), use_tqdm=False)
    assert outputs[0].num_cached_tokens == 0  # nothing under this salt yet
    assert outputs[1].num_cached_tokens > 0  # but the second shares the first's salted blocks
    assert token_ids(outputs) == reference[:2]


def test_reset_prefix_cache_forgets_everything(llm, prompts):
    llm.generate(prompts[:1], greedy(4), use_tqdm=False)
    assert llm.generate(prompts[:1], greedy(4), use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.engine.core.stats().num_cached_blocks == 0
    assert llm.generate(prompts[:1], greedy(4), use_tqdm=False)[0].num_cached_tokens == 0


def test_evicted_blocks_are_never_served_stale(smollm2_dir, prompts, reference):
    # 14 blocks (224 tokens) hold two of these ~75-token prompts with their outputs: every round
    # evicts blocks the previous rounds cached, and reuses what is left of them.
    small = LLM(smollm2_dir, dtype="float32", max_model_len=256, num_kv_blocks=14)
    for _ in range(2):
        for i in range(0, len(prompts), 2):
            assert token_ids(small.generate(prompts[i : i + 2], greedy(), use_tqdm=False)) == reference[i : i + 2]
    stats = small.engine.core.stats()
    assert stats.prefix_cache_evictions > 10 and stats.prefix_cache_hits > 0


# ---- preemption and priorities -------------------------------------------------------------------


def test_many_preemptions_give_the_same_greedy_tokens(smollm2_dir, llm):
    # Short prompts that fit at first (1 block each) and then grow to 4 blocks each, in a pool of
    # 8: requests are preempted over and over, and resumed by recompute.
    tokenizer = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(f"{i}. {q}")} for i, q in enumerate(QUESTIONS * 2)]
    params = greedy(44, ignore_eos=True)
    unconstrained = token_ids(llm.generate(prompts, params, use_tqdm=False))
    for caching in (True, False):
        small = LLM(smollm2_dir, dtype="float32", max_model_len=128, num_kv_blocks=8, enable_prefix_caching=caching)
        assert token_ids(small.generate(prompts, params, use_tqdm=False)) == unconstrained
        assert small.engine.core.stats().num_preemptions >= 5
        pool = small.engine.core.scheduler.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks
        del small


def test_a_request_that_can_never_fit_fails_with_a_clear_error(smollm2_dir, prompts):
    small = LLM(smollm2_dir, dtype="float32", max_model_len=512, num_kv_blocks=8)  # 128 tokens
    with pytest.raises(
        ValueError, match=r"^prompt: \d+ prompt tokens .* need \d+ KV blocks of 16 tokens, but the whole KV cache has 8"
    ):
        small.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [5] * 200}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^max_tokens: .* KV cache has 8"):
        small.generate([{"prompt_token_ids": [5] * 100}], greedy(max_tokens=40), use_tqdm=False)
    assert not small.engine.has_unfinished_requests() and not small.engine.core.has_unfinished_requests()
    assert (
        len(small.generate([{"prompt_token_ids": [5] * 100}], greedy(8), use_tqdm=False)[0].outputs[0].token_ids) == 8
    )


def run_with_priorities(engine: LLMEngine, prompts: list[dict], priorities: list[int], params: SamplingParams):
    """Every request at once; returns (the step each finished at, its tokens) by request index."""
    for i, (prompt, priority) in enumerate(zip(prompts, priorities)):
        engine.add_request(str(i), prompt, params, priority=priority)
    finished_at, tokens, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            if output.finished:
                finished_at[int(output.request_id)] = step
                tokens[int(output.request_id)] = output.outputs[0].token_ids
    return [finished_at[i] for i in range(len(prompts))], [tokens[i] for i in range(len(prompts))]


def same_until_eos(tokens: list[list[int]], reference: list[list[int]]) -> bool:
    """ignore_eos outputs continue past where the reference stopped."""
    return all(t[: len(r)] == r for t, r in zip(tokens, reference, strict=True))


def test_higher_priority_requests_finish_first(smollm2_dir, prompts, reference):
    priorities = [3, 0, 2, 1, 0, 3]
    engine = LLMEngine.from_engine_args(smollm2_dir, max_num_seqs=2, scheduling_policy="priority", **ENGINE)
    # Equal lengths, two at a time: the pair admitted together finishes together.
    finished_at, tokens = run_with_priorities(engine, prompts, priorities, greedy(24, ignore_eos=True))
    assert same_until_eos(tokens, reference)
    for a in range(len(prompts)):
        for b in range(len(prompts)):
            if priorities[a] < priorities[b]:
                assert finished_at[a] <= finished_at[b], (a, b, finished_at)
    assert finished_at[1] == finished_at[4] < finished_at[3] < finished_at[0] == finished_at[5]


def test_priority_preemption_takes_the_least_important_running_request(smollm2_dir, prompts, reference):
    # Room for both prompts but not for both to grow (no sharing: caching off): one running
    # request must be preempted, and it is the less important one although it started first.
    blocks = [-(-len(p["prompt_token_ids"]) // 16) for p in prompts[:2]]
    engine = LLMEngine.from_engine_args(
        smollm2_dir,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=sum(blocks) + 1,
        scheduling_policy="priority",
        enable_prefix_caching=False,
    )
    params = greedy(24, ignore_eos=True)
    engine.add_request("early-low", prompts[0], params, priority=5)
    engine.step()  # its prefill: it runs first
    engine.add_request("late-high", prompts[1], params, priority=0)
    finished, tokens = [], {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished.append(output.request_id)
                tokens[output.request_id] = output.outputs[0].token_ids
    assert finished == ["late-high", "early-low"]  # fcfs would have preempted the later one
    assert engine.core.stats().num_preemptions >= 1
    assert same_until_eos([tokens["early-low"], tokens["late-high"]], reference[:2])


def test_priority_needs_the_priority_policy(llm, prompts):
    with pytest.raises(ValueError, match="^priority: .*scheduling_policy"):
        llm.generate(prompts[:2], greedy(), priority=[0, 1], use_tqdm=False)
    with pytest.raises(ValueError, match="^priority: got 1 for 2 prompts"):
        llm.generate(prompts[:2], greedy(), priority=[0], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# ---- n > 1 -----------------------------------------------------------------------------------------


def test_n_completions_with_a_seed_repeat_exactly_and_share_the_prompt(llm, prompts):
    llm.reset_prefix_cache()
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=16)
    (first,) = llm.generate(prompts[:1], params, use_tqdm=False)
    (second,) = llm.generate(prompts[:1], params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert token_ids([first]) == token_ids([second])
    assert [c.text for c in first.outputs] == [c.text for c in second.outputs]
    assert len({tuple(t) for t in token_ids([first])}) > 1
    assert first.num_cached_tokens > 0  # the children after the first took the prompt from the cache
    # Child i is the request with seed + i.
    (child,) = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=1236, max_tokens=16), use_tqdm=False)
    assert child.outputs[0].token_ids == first.outputs[2].token_ids


def test_n_completions_mixed_with_single_ones_in_one_batch(llm, prompts, reference):
    params = [greedy(n=3), greedy(), SamplingParams(n=2, temperature=0.8, max_tokens=8)]
    outputs = llm.generate(prompts[:3], params, use_tqdm=False)
    assert [len(o.outputs) for o in outputs] == [3, 1, 2]
    assert token_ids(outputs[:1]) == [reference[0]] * 3  # greedy: three equal completions
    assert outputs[1].outputs[0].token_ids == reference[1]
    assert [o.request_id for o in outputs] == sorted(o.request_id for o in outputs)
    assert all(c.finished for o in outputs for c in o.outputs)


def test_aborting_an_n_request_aborts_every_completion(llm, prompts):
    engine = llm.engine
    engine.add_request("many", prompts[0], SamplingParams(n=3, max_tokens=50))
    engine.step()
    (aborted,) = engine.abort_request(["many"])
    assert [c.finish_reason for c in aborted.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests() and not engine.core.has_unfinished_requests()


# ---- logprobs ------------------------------------------------------------------------------------


def hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_position_matches(entry: dict, log_softmax_row: torch.Tensor, chosen: int, k: int) -> None:
    top = log_softmax_row.topk(k)
    assert set(entry) == {chosen, *top.indices.tolist()}
    assert abs(entry[chosen].logprob - float(log_softmax_row[chosen])) < 1e-4
    assert entry[chosen].rank == int((log_softmax_row > log_softmax_row[chosen]).sum()) + 1
    for rank, (token_id, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
        assert abs(entry[token_id].logprob - value) < 1e-4
        if token_id != chosen:
            assert entry[token_id].rank == rank


@pytest.mark.parametrize(
    "params",
    [
        greedy(12, logprobs=5, prompt_logprobs=3),
        SamplingParams(temperature=0.9, seed=5, max_tokens=12, logprobs=2, prompt_logprobs=0),
    ],
    ids=["greedy", "sampled"],
)
def test_logprobs_and_prompt_logprobs_match_hf_log_softmax(llm, hf_smollm2, prompts, params):
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(prompts[:2] + [{"prompt_token_ids": [1]}], params, use_tqdm=False)
    for output in outputs:
        prompt_ids = output.prompt_token_ids
        completion = output.outputs[0]
        log_softmax = hf_log_softmax(hf_smollm2, prompt_ids + completion.token_ids)
        assert len(completion.logprobs) == len(completion.token_ids)
        for t, (entry, token_id) in enumerate(zip(completion.logprobs, completion.token_ids)):
            assert_position_matches(entry, log_softmax[len(prompt_ids) - 1 + t], token_id, params.logprobs)
            assert entry[token_id].decoded_token == tokenizer.decode([token_id])
        expected_sum = sum(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids))
        assert completion.cumulative_logprob == pytest.approx(expected_sum, abs=1e-4)
        assert len(output.prompt_logprobs) == len(prompt_ids) and output.prompt_logprobs[0] is None
        for i in range(1, len(prompt_ids)):
            assert_position_matches(
                output.prompt_logprobs[i], log_softmax[i - 1], prompt_ids[i], params.prompt_logprobs
            )


def test_prompt_logprobs_survive_chunked_prefill(smollm2_dir, hf_smollm2, prompts):
    chunked = LLM(smollm2_dir, dtype="float32", max_model_len=512, num_kv_blocks=64, max_num_batched_tokens=24)
    (output,) = chunked.generate(prompts[:1], greedy(2, prompt_logprobs=1), use_tqdm=False)
    log_softmax = hf_log_softmax(hf_smollm2, output.prompt_token_ids)
    ids = output.prompt_token_ids
    assert len(ids) > 48
    for i in range(1, len(ids)):
        assert_position_matches(output.prompt_logprobs[i], log_softmax[i - 1], ids[i], 1)


# ---- penalties and other logits processors against HF generate ---------------------------------


class OpenAIPenalties(LogitsProcessor):
    """Presence/frequency penalties (OpenAI's formula) over the generated tokens, for HF generate."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(
            1, input_ids[:, self.prompt_len :], torch.ones_like(input_ids[:, self.prompt_len :], dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


@pytest.mark.parametrize(
    "case",
    ["repetition", "presence_frequency", "all_penalties", "min_tokens", "logit_bias", "bad_words"],
)
def test_greedy_with_logits_processors_matches_hf_generate(llm, hf_smollm2, prompts, case):
    eos = hf_smollm2.generation_config.eos_token_id
    tokenizer = llm.get_tokenizer()
    max_tokens = 32
    for prompt in prompts[:2]:
        ids = prompt["prompt_token_ids"]
        hf_kwargs: dict = {}
        if case == "repetition":
            params = greedy(max_tokens, repetition_penalty=1.4)
            hf_kwargs = dict(repetition_penalty=1.4)
        elif case == "presence_frequency":
            params = greedy(max_tokens, presence_penalty=1.2, frequency_penalty=0.6)
            hf_kwargs = dict(logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), 1.2, 0.6)]))
        elif case == "all_penalties":
            params = greedy(max_tokens, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5)
            hf_kwargs = dict(
                repetition_penalty=1.2, logits_processor=LogitsProcessorList([OpenAIPenalties(len(ids), 0.5, 0.5)])
            )
        elif case == "min_tokens":
            params = greedy(max_tokens, min_tokens=30)
            hf_kwargs = dict(min_new_tokens=30)
        elif case == "logit_bias":
            bias = {
                tokenizer.encode(" The", add_special_tokens=False)[0]: 8.0,
                tokenizer.encode(" shop", add_special_tokens=False)[0]: -100.0,
            }
            params = greedy(max_tokens, logit_bias=bias)
            hf_kwargs = dict(sequence_bias={(t,): v for t, v in bias.items()})
        else:
            words = ["nine", "receipt", "two days"]
            params = greedy(max_tokens, bad_words=words)
            hf_kwargs = dict(bad_words_ids=llm.engine.processor._bad_words_token_ids(words))
        expected = hf_greedy(hf_smollm2, ids, max_tokens, eos, **hf_kwargs)
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        assert output.outputs[0].token_ids == expected, case


def test_stop_token_ids_and_ignore_eos(llm, prompts, reference):
    first_new = next(j for j in range(1, len(reference[0])) if reference[0][j] not in reference[0][:j])
    stop = reference[0][first_new]
    (output,) = llm.generate(prompts[:1], greedy(stop_token_ids=[stop]), use_tqdm=False)
    assert output.outputs[0].token_ids == reference[0][: first_new + 1]
    assert output.outputs[0].stop_reason == stop
    eos = llm.engine.processor.eos_token_ids[0]
    (long,) = llm.generate(prompts[:1], greedy(48, ignore_eos=True, logit_bias={eos: 100.0}), use_tqdm=False)
    assert long.outputs[0].token_ids == [eos] * 48 and long.outputs[0].finish_reason == "length"


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(prompt_logprobs=50), "prompt_logprobs"),
        (SamplingParams(n=129), "n"),
        (SamplingParams(logit_bias={49152: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={3: 1.0, 10**6: -1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=[49152]), "stop_token_ids"),
    ],
    ids=["logprobs", "prompt_logprobs", "n", "logit_bias", "logit_bias-huge", "stop_token_ids"],
)
def test_out_of_range_requests_fail_naming_the_field(llm, prompts, params, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate(prompts[:2], [greedy(), params], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.core.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {1: 1000.0}}, "logit_bias"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_a_bad_cache_salt_is_rejected(llm, prompts):
    with pytest.raises(ValueError, match="^cache_salt:"):
        llm.generate([prompts[0] | {"cache_salt": ""}], greedy(), use_tqdm=False)


# ---- tensor parallelism -----------------------------------------------------------------------------


def test_sampling_features_are_the_same_at_tp_2(smollm2_dir, llm, prompts):
    """Only rank 0 sees the gathered logits and samples: logprobs, penalties and n work there."""
    params = [
        greedy(12, logprobs=3, prompt_logprobs=2, repetition_penalty=1.3, logit_bias={11: 2.0}),
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, logprobs=1, presence_penalty=0.5),
    ]
    expected = llm.generate(prompts[:2], params, use_tqdm=False)
    tp2 = LLM(smollm2_dir, tensor_parallel_size=2, **ENGINE)
    try:
        got = tp2.generate(prompts[:2], params, use_tqdm=False)
    finally:
        tp2.shutdown()
    assert token_ids(got) == token_ids(expected)
    for a, b in zip(got, expected):
        for ca, cb in zip(a.outputs, b.outputs):
            for ea, eb in zip(ca.logprobs, cb.logprobs):
                assert ea.keys() == eb.keys()
                assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
    for ea, eb in zip(got[0].prompt_logprobs[1:], expected[0].prompt_logprobs[1:]):
        assert ea.keys() == eb.keys() and all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
