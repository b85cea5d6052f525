"""Async scheduling on a GPU: the same tokens as synchronous steps for every sampling feature,
and no host synchronisation while a step is launched and sampled (which is what lets the host
prepare step N+1 while the device still runs step N)."""

from __future__ import annotations

import pytest

from tests.helpers.gpu import forbid_host_syncs
from tests.helpers.models import save_tiny_model
from zllm import LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24),
    SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=2, max_tokens=24),
    SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=24),
    SamplingParams(temperature=0.0, logit_bias={7: 5.0, 9: -100.0}, max_tokens=24),
    SamplingParams(temperature=0.0, min_tokens=12, max_tokens=24),
    SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2, max_tokens=24),
    SamplingParams(temperature=0.7, seed=3, stop_token_ids=[11], max_tokens=24),
]
PROMPT_LENGTHS = [1, 5, 17, 33, 64, 130, 250, 400]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("async")
    save_tiny_model(
        directory,
        "llama",
        vocab_size=256,
        max_position_embeddings=4096,
        initializer_range=0.2,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    return str(directory)


def _run(model_dir: str, spy=None, **engine_args) -> dict[str, tuple]:
    import random

    engine = LLMEngine.from_engine_args(
        model_dir, device="cuda", max_model_len=1024, max_num_batched_tokens=256, **engine_args
    )
    try:
        if spy is not None:
            spy(engine)
        rng = random.Random(0)
        results = {}

        def step() -> None:
            for out in engine.step():
                if out.finished:
                    completion = out.outputs[0]
                    logprobs = [sorted(d) for d in completion.logprobs] if completion.logprobs else None
                    results[out.request_id] = (completion.token_ids, completion.finish_reason, logprobs)

        for i, length in enumerate(PROMPT_LENGTHS * 2):
            ids = [rng.randrange(3, 256) for _ in range(length)]
            engine.add_request(str(i), {"prompt_token_ids": ids}, PARAMS[i % len(PARAMS)])
            if i % 3 == 2:
                step()  # staggered arrival: requests join a running batch
        while engine.has_unfinished_requests():
            step()
    finally:
        engine.shutdown()
    return results


def test_async_scheduling_gives_the_same_tokens_as_sync(model_dir):
    sync = _run(model_dir, async_scheduling=False)
    pipelined = _run(model_dir, async_scheduling=True)
    assert len(sync) == 2 * len(PROMPT_LENGTHS)
    assert pipelined == sync


def test_launch_and_sample_never_wait_for_the_device(model_dir):

    def forbid_syncs(engine):
        runner = engine.core.executor.runner
        forbid_host_syncs(runner)

    # Eager (prefill, mixed batches) and graphs (decode) both; every sampling feature.
    assert len(_run(model_dir, spy=forbid_syncs, async_scheduling=True)) == 2 * len(PROMPT_LENGTHS)
    assert len(_run(model_dir, spy=forbid_syncs, async_scheduling=True, enforce_eager=True)) == 2 * len(PROMPT_LENGTHS)
