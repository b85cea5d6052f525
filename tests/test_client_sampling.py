"""n > 1, logprobs, prefix-cache stats and reset through the Client, against a real `vllm-launch`
process tree (frontend, engine core, worker over ZeroMQ)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from zllm import AsyncClient, Client, SamplingParams
from zllm.client import RequestError

pytestmark = pytest.mark.slow

SYSTEM = "You are a terse assistant. " * 12  # several full KV blocks shared by every request
PROMPT = SYSTEM + "Name a colour:"


def test_n_completions_with_logprobs_through_the_client(server, hf_smollm2):
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, logprobs=3, prompt_logprobs=2)
    with Client(server.endpoint) as client:
        first = client.generate(PROMPT, params)
        second = client.generate(PROMPT, params)
    assert [c.index for c in first.outputs] == [0, 1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert [c.text for c in first.outputs] == [c.text for c in second.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert second.num_cached_tokens >= 16 * (len(first.prompt_token_ids) // 16 - 1)
    ids = first.prompt_token_ids
    for completion in first.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        with torch.inference_mode():
            logits = hf_smollm2(torch.tensor([ids + completion.token_ids])).logits[0].float()
        log_softmax = torch.log_softmax(logits, dim=-1)
        for t, (entry, token_id) in enumerate(zip(completion.logprobs, completion.token_ids)):
            row = log_softmax[len(ids) - 1 + t]
            assert abs(entry[token_id].logprob - float(row[token_id])) < 1e-4
            assert set(entry) == {token_id, *row.topk(3).indices.tolist()}
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids)), abs=1e-4
        )
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(ids)
    assert abs(first.prompt_logprobs[1][ids[1]].logprob - float(log_softmax[0, ids[1]])) < 1e-4


def test_streaming_n_completions_ends_once_all_are_done(server):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)

    async def scenario():
        async with AsyncClient(server.endpoint) as client:
            return [delta async for delta in client.stream(PROMPT, params)]

    deltas = asyncio.run(scenario())
    assert {d.outputs[0].index for d in deltas} == {0, 1, 2}
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    per_index = {i: [t for d in deltas if d.outputs[0].index == i for t in d.outputs[0].token_ids] for i in range(3)}
    assert per_index[0] == per_index[1] == per_index[2] and len(per_index[0]) == 6


def test_prefix_cache_stats_and_reset_through_the_client(server):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with Client(server.endpoint) as client:
        assert client.reset_prefix_cache() is True
        assert client.stats()["num_cached_blocks"] == 0
        cold = client.generate(PROMPT, params)
        warm = client.generate(PROMPT, params)
        stats = client.stats()
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert stats["prefix_cache_hits"] >= warm.num_cached_tokens and stats["prefix_cache_hit_rate"] > 0


def test_bad_sampling_values_come_back_as_request_errors(server):
    with Client(server.endpoint) as client:
        for params, field in [(SamplingParams(logprobs=99), "logprobs"), (SamplingParams(n=1000), "n")]:
            with pytest.raises(RequestError, match=f"^{field}:"):
                client.generate("Hi", params)
        with pytest.raises(RequestError, match="^priority:"):
            client.generate("Hi", SamplingParams(max_tokens=2), priority=3)
        assert client.generate("Hi", SamplingParams(max_tokens=2)).outputs[0].finish_reason is not None
