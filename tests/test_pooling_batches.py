"""Pooling batches (LLM's offline path: one AddPoolingBatch per tokenized chunk, no Request per
input) against the per-request path and sentence-transformers on the real all-MiniLM-L6-v2 (fp32,
CPU); the pooling scheduler's slices step by step; bad inputs inside a batch; a batch beside
single pooling requests in one engine core."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.pooling import minilm_dir, mixed_sentences
from zllm import LLM, PoolingParams, SamplingParams
from zllm.config import EngineConfig
from zllm.enginecore.block_pool import BlockPool
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.pooling_scheduler import PoolingScheduler
from zllm.enginecore.request import Request
from zllm.ipc.messages import AddPoolingBatch, ArrayData, PooledSlice, StepOutput
from zllm.pooling import POOLING_SAMPLING


@pytest.fixture(scope="module")
def minilm():
    # A small budget and async scheduling: a batch is cut into slices over many pipelined steps.
    llm = LLM(minilm_dir(), device="cpu", async_scheduling=True, max_num_batched_tokens=600, max_num_seqs=16)
    yield llm
    llm.shutdown()


class _Calls:
    """Counts the calls of some of an object's methods (the object's own attributes, undone after)."""

    def __init__(self, monkeypatch, owner, *names: str) -> None:
        self.counts = dict.fromkeys(names, 0)
        self.steps = []
        for name in names:
            inner = getattr(owner, name)

            def counted(*args, _name=name, _inner=inner, **kwargs):
                self.counts[_name] += 1
                result = _inner(*args, **kwargs)
                if _name == "schedule":
                    self.steps.append(result)
                return result

            monkeypatch.setattr(owner, name, counted)


def test_batches_equal_the_per_request_path_and_sentence_transformers(minilm, monkeypatch):
    from sentence_transformers import SentenceTransformer

    import zllm.launch.llm as offline

    monkeypatch.setattr(offline, "_TOKENIZE_CHUNK", 24)
    tokenizer = minilm.get_tokenizer()
    sentences = mixed_sentences(64)
    prompts = [s if i % 4 else {"prompt_token_ids": tokenizer.encode(s)} for i, s in enumerate(sentences)]
    core = minilm.engine.core
    calls = _Calls(monkeypatch, core, "add_request", "add_pooling_batch")
    scheduled = _Calls(monkeypatch, core.scheduler, "schedule")
    batched = minilm.embed(prompts, use_tqdm=False)
    assert calls.counts == {"add_request": 0, "add_pooling_batch": 3}  # 64 inputs in chunks of 24
    slices = [s for step in scheduled.steps for s in step.pooling_slices]
    assert len(slices) > 3 and all(s.lengths.shape[0] <= 16 for s in slices)  # budget and seats cut them
    assert [o.prompt_token_ids for o in batched] == [tokenizer.encode(s) for s in sentences]  # in order

    monkeypatch.setattr(minilm, "_batchable", lambda prompts: False)
    one_by_one = minilm.embed(prompts, use_tqdm=False)
    assert calls.counts == {"add_request": 64, "add_pooling_batch": 3}
    ours = np.array([o.outputs.embedding for o in batched])
    assert np.allclose(ours, [o.outputs.embedding for o in one_by_one], atol=1e-6)
    assert [o.prompt_token_ids for o in batched] == [o.prompt_token_ids for o in one_by_one]
    reference = SentenceTransformer(minilm_dir(), device="cpu").encode(sentences, convert_to_numpy=True)
    cosines = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.99999
    # The outputs are vLLM's: lists of floats, and the raw vectors of `encode` as well.
    assert type(batched[0].outputs.embedding) is list and type(batched[0].outputs.embedding[0]) is float
    assert batched[1].outputs.hidden_size == 384 and batched[1].outputs == one_by_one[1].outputs
    raw = minilm.encode(sentences[:3], use_tqdm=False)
    assert np.allclose(ours[:3], [np.divide(o.outputs.data, np.linalg.norm(o.outputs.data)) for o in raw], atol=1e-6)


def test_bad_inputs_inside_a_batch_fail_as_single_ones_do(minilm, monkeypatch):
    import zllm.launch.llm as offline

    monkeypatch.setattr(offline, "_TOKENIZE_CHUNK", 4)
    sentences = mixed_sentences(10)
    core = minilm.engine.core
    cases = [
        ({"prompt_token_ids": [1000] * 300}, "input: 300 tokens exceed the model's maximum of 256 tokens"),
        ("", "prompt: must not be empty"),
        ({"prompt_token_ids": []}, "prompt_token_ids: must not be empty"),
        ({"prompt_token_ids": [1, 10**6]}, r"prompt_token_ids: token id\(s\) \[1000000\] outside the vocabulary"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids: must be a list of integers"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            minilm.embed(bad, use_tqdm=False)
        # In a later chunk: the earlier chunks were in the engine already, and are aborted.
        with pytest.raises(ValueError, match=message):
            minilm.embed([*sentences[:9], bad], use_tqdm=False)
        assert not core.scheduler.batches and not core.scheduler.requests  # steps in flight may remain
    with pytest.raises(ValueError, match="prompts: must not be empty"):
        minilm.embed([], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
        minilm.embed(sentences, PoolingParams(dimensions=8), use_tqdm=False)
    assert len(minilm.embed(sentences, use_tqdm=False)) == 10  # and it serves on


def test_a_batch_beside_single_requests_in_one_core(minilm, monkeypatch):
    """Single pooling requests (the HTTP path's) and a batch share steps; each gets its vectors;
    a batch aborted half-way leaves nothing behind."""
    core, processor = minilm.engine.core, minilm.engine.processor
    scheduled = _Calls(monkeypatch, core.scheduler, "schedule")
    sentences = mixed_sentences(30)
    token_ids = minilm.get_tokenizer()(sentences)["input_ids"]
    batch, _ = processor.process_pooling_batch("mixed-batch", sentences, token_ids, PoolingParams(task="encode"))
    core.add_pooling_batch(batch)
    for index in (0, 7, 29):
        single = processor.process(f"single-{index}", sentences[index], POOLING_SAMPLING, pooling=PoolingParams())
        core.add_request(single[0])
    pooled, vectors = {}, {}
    while core.has_unfinished_requests():
        for delta in core.step():
            pooled[delta.request_id] = np.frombuffer(delta.pooled, dtype="<f4")
        for answer in core.take_pooled_slices():
            for offset, row in enumerate(answer.vectors.to_numpy()):
                vectors[answer.first + offset] = row
    assert sorted(vectors) == list(range(30)) and set(pooled) == {"single-0", "single-7", "single-29"}
    for index in (0, 7, 29):  # the same raw vector (encode) either way
        assert np.allclose(pooled[f"single-{index}"], vectors[index], atol=1e-6)
    assert any(step.new_requests and step.pooling_slices for step in scheduled.steps)  # they shared a step

    core.add_pooling_batch(AddPoolingBatch("aborted", batch.token_ids, batch.lengths, batch.pooling, 0.0))
    core.step()
    assert core.abort_pooling_batches(["aborted"]) == ["aborted"]
    while core.has_unfinished_requests():
        core.step()
    assert core.take_pooled_slices() == [] and not core.scheduler.batches


# ---- the scheduler's slices ------------------------------------------------------------------


def _scheduler(**limits) -> PoolingScheduler:
    config = EngineConfig(model="unused", max_model_len=256, runner="pooling", **limits)
    return PoolingScheduler(config, KVCacheManager(BlockPool(1), 16, False))


def _batch(batch_id: str, lengths: list[int]) -> AddPoolingBatch:
    token_ids = np.concatenate([np.full(n, i + 1, dtype=np.int32) for i, n in enumerate(lengths)])
    return AddPoolingBatch.of(batch_id, token_ids, np.array(lengths, dtype=np.int32), PoolingParams(), 0.0)


def _answer(step, width: int = 2) -> StepOutput:
    answers = [
        PooledSlice(s.batch_id, s.first, ArrayData.of(np.full((s.lengths.shape[0], width), s.first, dtype=np.float32)))
        for s in step.pooling_slices
    ]
    return StepOutput(step.step_id, step.scheduled_ids, [], pooled_slices=answers)


def test_pooling_scheduler_slices_batches_under_the_budget_and_seats():
    scheduler = _scheduler(max_num_batched_tokens=64, max_num_seqs=4)
    scheduler.add_request(Request("single", [5] * 12, SamplingParams(max_tokens=1), pooling=PoolingParams()))
    scheduler.add_batch(_batch("b1", [10, 20, 30, 5, 5, 5, 40]))
    scheduler.add_batch(_batch("b2", [3, 3]))
    assert scheduler.stats().num_waiting == 1 + 9

    step = scheduler.schedule()  # the single request first; then 52 tokens and 3 seats for b1
    assert step.scheduled_ids == ["single"]
    (part,) = step.pooling_slices
    assert (part.batch_id, part.first, part.lengths.to_numpy().tolist()) == ("b1", 0, [10, 20])
    assert part.token_ids.to_numpy().tolist() == [1] * 10 + [2] * 20  # its inputs' own ids
    scheduler.update_from_output(_answer(step))
    assert [(a.batch_id, a.first) for a in scheduler.take_pooled_slices()] == [("b1", 0)]

    step = scheduler.schedule()  # 30 + 5 + 5 + 5 = 45 (then 40 does not fit); 4 seats
    assert [(s.batch_id, s.first, s.lengths.to_numpy().tolist()) for s in step.pooling_slices] == [
        ("b1", 2, [30, 5, 5, 5])
    ]
    step_2 = scheduler.schedule()  # in flight behind it (async): b1's last input, then b2 whole
    assert [(s.batch_id, s.first, s.lengths.shape[0]) for s in step_2.pooling_slices] == [("b1", 6, 1), ("b2", 0, 2)]
    assert scheduler.stats().num_waiting == 0 and scheduler.stats().num_running == 7
    scheduler.update_from_output(_answer(step))
    scheduler.abort_batches(["b2"])  # its answer is dropped when it comes
    scheduler.update_from_output(_answer(step_2))
    assert [(a.batch_id, a.first) for a in scheduler.take_pooled_slices()] == [("b1", 2), ("b1", 6)]
    assert not scheduler.has_unfinished_requests() and scheduler.schedule().is_empty


def test_pooling_scheduler_checks_a_batch_as_one_unit():
    scheduler = _scheduler(max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="input: 65 tokens \\(input 1 of batch b\\)"):
        scheduler.add_batch(_batch("b", [3, 65, 2]))
    with pytest.raises(ValueError, match="a pooling batch must not be empty"):
        scheduler.add_batch(AddPoolingBatch.of("e", np.zeros(0, np.int32), np.zeros(0, np.int32), PoolingParams(), 0))
    bad = _batch("short", [3, 4])
    bad.token_ids = ArrayData.of(np.zeros(5, dtype=np.int32))
    with pytest.raises(ValueError, match="token_ids: 5 ids for inputs of 7 tokens"):
        scheduler.add_batch(bad)
    scheduler.add_batch(_batch("b", [3]))
    with pytest.raises(ValueError, match="batch_id: 'b' is already in use"):
        scheduler.add_batch(_batch("b", [3]))
    assert list(scheduler.batches) == ["b"]
