"""The engine's greedy tokens equal HF transformers' generate exactly (fp32, CPU, SmolLM2-135M).

All prompts run as one continuous batch with staggered arrival; then again with a KV cache so
small that requests are preempted, and with a token budget so small that every prompt is chunked.
Each runs with and without async scheduling (step N+1 scheduled while step N runs, its inputs
taking step N's tokens on the worker).
"""

from __future__ import annotations

import pytest

from tests.helpers.models import hf_greedy
from zllm import LLMEngine, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 24

_LONG_TEXT = " ".join(
    f"Section {i}: the river carried sediment from the mountains to the delta, where farmers planted rice."
    for i in range(18)
)
RAW_PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:\n1.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    _LONG_TEXT + "\nSummary:",  # > 300 tokens
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    tok = smollm2_tokenizer
    raw = [tok.encode(p) for p in RAW_PROMPTS]
    chat = [
        tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for m in CHAT_PROMPTS
    ]
    ids = raw + chat
    lengths = sorted(len(p) for p in ids)
    assert lengths[0] <= 4 and lengths[-1] > 300, lengths
    return ids


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2, prompt_ids) -> list[list[int]]:
    eos = hf_smollm2.generation_config.eos_token_id
    return [hf_greedy(hf_smollm2, ids, MAX_TOKENS, eos) for ids in prompt_ids]


def run_staggered(engine: LLMEngine, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Add two requests, step, add two more, ...: requests join a batch already running."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    pending = list(enumerate(prompt_ids))
    results: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                i, ids = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return [results[str(i)] for i in range(len(prompt_ids))]


ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def drain(engine: LLMEngine) -> None:
    """Collect the steps still in flight (async scheduling) so every block is back."""
    while engine.core.has_unfinished_requests():
        engine.step()


@ASYNC
def test_continuous_batch_matches_hf(smollm2_dir, prompt_ids, hf_reference, async_scheduling):
    engine = LLMEngine.from_engine_args(smollm2_dir, dtype="float32", async_scheduling=async_scheduling)
    assert run_staggered(engine, prompt_ids) == hf_reference
    drain(engine)
    assert engine.core.scheduler.kv_cache.pool.num_free_blocks == engine.core.num_kv_blocks


@ASYNC
def test_preemption_matches_hf(smollm2_dir, prompt_ids, hf_reference, async_scheduling):
    # 40 blocks x 16 tokens = 640 tokens for ~1,000 tokens of concurrent context: must preempt.
    engine = LLMEngine.from_engine_args(
        smollm2_dir, dtype="float32", num_kv_blocks=40, max_model_len=640, async_scheduling=async_scheduling
    )
    assert run_staggered(engine, prompt_ids) == hf_reference
    drain(engine)
    assert engine.core.stats().num_preemptions > 0
    assert engine.core.scheduler.kv_cache.pool.num_free_blocks == 40


@ASYNC
def test_chunked_prefill_matches_hf(smollm2_dir, prompt_ids, hf_reference, async_scheduling):
    engine = LLMEngine.from_engine_args(
        smollm2_dir, dtype="float32", max_num_batched_tokens=8, async_scheduling=async_scheduling
    )
    chunked = []
    original_step = engine.core.executor.submit_step

    def spy(step):
        chunked.extend(n for n in step.num_scheduled_tokens if n > 1)
        return original_step(step)

    engine.core.executor.submit_step = spy
    assert run_staggered(engine, prompt_ids) == hf_reference
    assert chunked and max(chunked) <= 8


@pytest.mark.parametrize("budget", [2048, 64], ids=["whole-prompts", "chunks"])
def test_piecewise_forward_matches_hf(smollm2_dir, prompt_ids, hf_reference, budget):
    """piecewise_cuda_graphs: the forward split at attention over static, padded buffers (on CPU
    the pieces run eagerly: the same code the GPU captures) gives HF's tokens, whole prompts and
    chunks alike."""
    from zllm.workers.piecewise_graphs import EagerPieces

    engine = LLMEngine.from_engine_args(
        smollm2_dir, dtype="float32", piecewise_cuda_graphs=True, max_num_batched_tokens=budget
    )
    runner = engine.core.executor.runner  # tp 1: the worker runs in this process
    assert isinstance(runner.pieces, EagerPieces) and runner.pieces.sizes[-1] == budget
    padded = []
    original = runner.pieces.run

    def spy(input_ids, positions, meta):
        padded.append(runner.pieces.bucket(input_ids.shape[0]) - input_ids.shape[0])
        return original(input_ids, positions, meta)

    runner.pieces.run = spy
    assert run_staggered(engine, prompt_ids) == hf_reference
    assert len(padded) > MAX_TOKENS and any(padded)  # every step went through the pieces, most of them padded


@ASYNC
def test_prompt_tokens_as_decode_rows_match_hf(smollm2_dir, prompt_ids, hf_reference, async_scheduling, monkeypatch):
    """mixed_graph_max_tokens: a step's prompt tokens go in as decode rows (each attends to the
    cache up to its own position), the path that replays the decode CUDA graph on a GPU; on CPU
    the same rows run eagerly through the decode attention. With the mean-context limit at 128,
    the long prompt's later chunks (a long prefix each) keep packed prefill, in the same run."""
    from zllm.workers import model_runner

    monkeypatch.setattr(model_runner, "_ROWS_MAX_MEAN_CONTEXT", 128)
    engine = LLMEngine.from_engine_args(
        smollm2_dir,
        dtype="float32",
        max_num_batched_tokens=64,
        mixed_graph_max_tokens=64,
        async_scheduling=async_scheduling,
    )
    runner = engine.core.executor.runner
    prefill_steps = []  # whether each step with prompt tokens took them as rows
    original = runner._prefill_as_rows

    def spy(step):
        as_rows = original(step)
        if any(count > 1 for count in step.num_scheduled_tokens):
            prefill_steps.append(as_rows)
        return as_rows

    runner._prefill_as_rows = spy
    row_steps = []  # the forwards whose every token was a decode row though some were prompt tokens
    forward = runner._forward

    def forward_spy(batch):
        meta = batch.attention
        if len(meta.seq_lens_list) > len({id(s) for s in batch.scheduled_states}):
            row_steps.append(meta.num_decodes == batch.input_ids.shape[0] and meta.prefill is None)
        return forward(batch)

    runner._forward = forward_spy
    assert run_staggered(engine, prompt_ids) == hf_reference
    assert any(prefill_steps) and not all(prefill_steps), prefill_steps
    assert row_steps and all(row_steps) and len(row_steps) == sum(prefill_steps)
