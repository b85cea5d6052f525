"""Batch-1 decoding served as issue 30 measures it (benchmarks/served_itl.py): through real
processes and sockets with async scheduling, the streamed tokens are HF's, one per delta."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.models import hf_greedy, save_tiny_llama
from tests.helpers.server import start_server
from zllm import AsyncClient, SamplingParams

PROMPT = [5, 17, 42, 99, 7, 3, 64, 128, 11, 250, 31, 8]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def hf_tokens(tiny) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype="float32")
    return hf_greedy(model, PROMPT, MAX_TOKENS, eos_token_id=None)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_served_async_stream_is_hf_one_token_per_delta(tmp_path, tiny, hf_tokens):
    server = start_server(tmp_path, tiny, "--dtype", "float32", "--max-model-len", "512", "--async-scheduling")

    async def stream() -> list[list[int]]:
        async with AsyncClient(server.endpoint) as client:
            return [
                list(delta.outputs[0].token_ids)
                async for delta in client.stream(prompt_token_ids=PROMPT, sampling_params=_greedy())
            ]

    try:
        deltas = asyncio.run(stream())
    finally:
        server.stop()
    assert [token for delta in deltas for token in delta] == hf_tokens
    assert [len(delta) for delta in deltas] == [1] * MAX_TOKENS
