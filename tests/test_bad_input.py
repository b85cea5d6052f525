"""Bad input gets a ValueError naming the field, and leaves every other request untouched."""

from __future__ import annotations

import math

import pytest

from zllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, max_model_len=64)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("", "prompt"),
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2, 10**9]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -3]}, "prompt_token_ids"),
        ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids"),
        ({"nothing": 1}, "prompt"),
        (42, "prompt"),
        ("word " * 80, "prompt"),  # longer than max_model_len=64
        ({"prompt_token_ids": list(range(64))}, "prompt"),
    ],
)
def test_bad_prompt_is_rejected_and_nothing_queued(llm, prompt, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate(["A fine prompt", prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.core.has_unfinished_requests()


def test_sampling_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="^sampling_params:"):
        llm.generate(["a", "b"], [GREEDY] * 3, use_tqdm=False)


def test_unknown_stop_token_id_is_rejected(llm):
    with pytest.raises(ValueError, match="^stop_token_ids:"):
        llm.generate("Hi", SamplingParams(stop_token_ids=[10**7]), use_tqdm=False)


def test_bad_requests_do_not_disturb_a_running_batch(llm):
    prompts = ["The capital of France is", "List three colors:", "def add(a, b):"]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"good-{i}", prompt, GREEDY)
    results = {}
    bad_inputs = [("", GREEDY), ("word " * 80, GREEDY), ({"prompt_token_ids": [10**9]}, GREEDY)]
    while engine.has_unfinished_requests():
        if bad_inputs:
            prompt, params = bad_inputs.pop()
            with pytest.raises(ValueError):
                engine.add_request(f"bad-{len(bad_inputs)}", prompt, params)
        results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [results[f"good-{i}"] for i in range(3)] == expected
    assert engine.core.scheduler.kv_cache.pool.num_free_blocks == engine.core.num_kv_blocks


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("dup", "Hello", GREEDY)
    with pytest.raises(ValueError, match="^request_id:"):
        engine.add_request("dup", "Hello again", GREEDY)
    engine.abort_request(["dup"])
    assert not engine.has_unfinished_requests()
