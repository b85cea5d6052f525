"""Batch-1 decoding as issue 30 measures it, offline and served (benchmarks/served_itl.py).

A CPU worker under async scheduling answers the step it holds before it computes the next one
(its forward runs inside launch_step, so launching first would hold the answer back by a whole
forward); the tokens stay HF's, in process and through real processes and sockets, one token
per streamed delta."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.models import hf_greedy, save_tiny_llama
from tests.helpers.server import start_server
from zllm import LLM, AsyncClient, SamplingParams

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


def test_cpu_worker_answers_before_it_computes_the_next_step(tiny, hf_tokens):
    llm = LLM(tiny, dtype="float32", async_scheduling=True, kv_cache_memory_bytes=64 << 20)
    runner = llm.engine.core.executor.runner
    calls: list[tuple[str, int]] = []
    launch, finish = runner.launch_step, runner.finish_step

    def launch_step(step):
        calls.append(("launch", step.step_id))
        return launch(step)

    def finish_step(launched):
        calls.append(("finish", launched.step_id))
        return finish(launched)

    runner.launch_step, runner.finish_step = launch_step, finish_step
    try:
        (output,) = llm.generate([{"prompt_token_ids": PROMPT}], _greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    assert list(output.outputs[0].token_ids) == hf_tokens
    launches = [step for kind, step in calls if kind == "launch"]
    assert len(launches) == MAX_TOKENS  # the prompt's step, then one per token but the last
    for earlier, later in zip(launches, launches[1:]):
        # Step `earlier` was answered before step `later` began computing.
        assert calls.index(("finish", earlier)) < calls.index(("launch", later))


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
