"""Pooling steps padded for CUDA graphs (zllm/workers/pooling_graphs.py), on CPU: the buckets a
step picks, the padded layout, and the padded forward against the unpadded one. A CPU stand-in
for FlashAttention's varlen kernel leaves the rows it does not compute (padding rows, which no
input of cu_seqlens covers) as NaN, so a padding row that reached a real one would show."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.pooling import mixed_sentences, save_tiny_decoder, save_tiny_encoder, save_tiny_modernbert
from zllm import LLM
from zllm.config import EngineConfig
from zllm.ipc.messages import NewRequestData, StepInput
from zllm.pooling import POOLING_SAMPLING
from zllm.workers import pooling_runner
from zllm.workers.models import bert, decoder_pooling, modernbert
from zllm.workers.pooling_graphs import (
    EagerPoolingSteps,
    max_len_options,
    padded_layout,
    pooling_graph_sizes,
)
from zllm.workers.pooling_runner import PoolingRunner


def _kernel_stand_in(q, k, v, packed, causal, scale, window=None):
    """What FlashAttention's varlen kernel computes, input by input: rows of no input (or past
    max_len) are not computed (NaN here, whatever memory held on a GPU); empty inputs skipped;
    window: keys less than `window` away either side (ModernBERT's local layers)."""
    bounds = packed.cu_seqlens.tolist()
    out = torch.full((q.shape[0], q.shape[1], q.shape[2]), float("nan"), dtype=q.dtype)
    for start, stop in zip(bounds, bounds[1:]):
        stop = min(stop, start + packed.max_len)
        if stop <= start:
            continue
        qi, ki, vi = (t[start:stop].transpose(0, 1) for t in (q, k, v))
        repeat = qi.shape[0] // ki.shape[0]
        ki, vi = ki.repeat_interleave(repeat, 0), vi.repeat_interleave(repeat, 0)
        mask = None
        if window is not None:
            columns = torch.arange(stop - start)
            mask = (columns[:, None] - columns[None, :]).abs() < window
        attended = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale
        )
        out[start:stop] = attended.transpose(0, 1)
    return out.reshape(q.shape[0], -1)


@pytest.fixture
def packed_on_cpu(monkeypatch):
    """The packed path (and so the padded steps) on CPU, through the kernel's stand-in."""
    monkeypatch.setattr(bert, "varlen_attention", _kernel_stand_in)
    monkeypatch.setattr(decoder_pooling, "varlen_attention", _kernel_stand_in)
    monkeypatch.setattr(modernbert, "varlen_attention", _kernel_stand_in)
    monkeypatch.setattr(pooling_runner, "packs_inputs", lambda *_: True)


def test_token_buckets_pad_by_at_most_a_quarter():
    for budget in (16, 100, 2048, 8192, 16384, 10**6):
        sizes = pooling_graph_sizes(budget)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(budget, 16384)
        for small, large in zip(sizes[3:], sizes[4:]):
            assert large <= small * 1.25
    assert len(pooling_graph_sizes(16384)) <= 40  # a bounded number of graphs per max_len


def test_max_len_options_bound_every_input_a_bucket_can_hold():
    for tokens in (16, 64, 100, 4096, 16384):
        for max_model_len in (256, 512, 32768):
            options = max_len_options(tokens, max_model_len)
            assert options == sorted(set(options)) and options[-1] == min(tokens, max_model_len)
            assert all(b <= 4 * a for a, b in zip(options, options[1:]))


def _steps(max_num_seqs: int = 8, budget: int = 512, max_model_len: int = 300) -> EagerPoolingSteps:
    model = torch.nn.Linear(2, 2)
    model.head, model.head_pooling = None, "cls"
    return EagerPoolingSteps(model, "mean", budget, max_num_seqs, max_model_len)


def test_a_step_takes_the_smallest_graph_that_holds_it():
    steps = _steps()
    for tokens, longest, inputs in [(1, 1, 1), (16, 16, 1), (17, 3, 7), (100, 65, 2), (300, 256, 4), (512, 300, 8)]:
        size, max_len = steps.key(tokens, longest, inputs)
        assert size == min(s for s in steps.sizes if s >= tokens)
        assert max_len == min(m for m in max_len_options(size, 300) if m >= longest)
        assert steps.seats(size) > inputs
    assert steps.key(513, 10, 60) is None  # over the largest graph: eager
    assert steps.key(200, 301, 1) is None  # an input longer than any bound captured


def test_long_bounds_are_not_captured_where_the_grid_would_be_mostly_empty():
    # 16,384 tokens, 1,024 seats, a 32k-token model: bounds past 1,024 would launch 32+ row
    # blocks per seat; a 4,096-token bucket with 16 seats keeps every bound up to 4,096.
    steps = _steps(max_num_seqs=1024, budget=16384, max_model_len=32768)
    assert [m for t, m in steps.keys if t == 16384] == [64, 256, 1024]
    few_seats = _steps(max_num_seqs=16, budget=16384, max_model_len=32768)
    assert [m for t, m in few_seats.keys if t == 4096] == [64, 256, 1024, 4096]
    assert steps.key(4000, 2000, 100) is None and few_seats.key(4000, 2000, 10) == (4096, 4096)


def test_the_padded_layout_keeps_real_inputs_apart_from_padding():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 40, size=rng.integers(1, 9))
        tokens = int(lengths.sum()) + int(rng.integers(0, 30))
        seats = len(lengths) + 1 + int(rng.integers(0, 5))
        for reads_last in (False, True):
            cu, segment, pick, counts = padded_layout(lengths, tokens, seats, reads_last)
            count, real = len(lengths), int(lengths.sum())
            assert len(cu) == seats + 1 and len(segment) == tokens and len(pick) == len(counts) == seats
            assert np.array_equal(np.diff(cu)[:count], lengths) and cu[count] == real
            assert (cu[count + 1 :] == real).all()  # empty seats: the kernel never sees padding rows
            assert np.array_equal(segment[:real], np.repeat(np.arange(count), lengths))
            assert (segment[real:] == count).all()  # padding rows pool into the padding seat
            assert np.array_equal(pick[:count], cu[1 : count + 1] - 1 if reads_last else cu[:count])
            assert np.array_equal(counts[:count], lengths) and (counts[count:] == 1).all()


def _runner(model_dir, pooling_type: str | None = None, **engine_args) -> PoolingRunner:
    config = EngineConfig.create(str(model_dir), device="cpu", usage="offline", **engine_args)
    runner = PoolingRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.pooling_type = pooling_type or runner.pooling_type
    runner.capture_graphs()
    return runner


def _step(prompts: list[list[int]]) -> StepInput:
    requests = [NewRequestData(str(i), len(p), p, POOLING_SAMPLING, [], 0) for i, p in enumerate(prompts)]
    return StepInput(1, requests, [], [r.request_id for r in requests], [len(p) for p in prompts])


def _batches(vocab: int) -> list[list[list[int]]]:
    """Steps crossing the buckets: 1 token, 16 / 17, a mix past 128, many short inputs."""
    rng = np.random.default_rng(1)
    shapes = [[1], [16], [9, 8], [3, 5, 1, 7, 2], [64, 1, 63, 2], [100, 40, 1], [7] * 20, [150, 3]]
    return [[rng.integers(3, vocab, size=n).tolist() for n in shape] for shape in shapes]


@pytest.mark.parametrize(
    "kind, pooling_type",
    [
        ("bert", "mean"),
        ("bert", "cls"),
        ("qwen3", "last"),
        ("qwen3", "mean"),
        ("bert-classifier", None),
        ("modernbert-mean-classifier", None),  # the head reads the mean of each input's rows
    ],
)
def test_padded_steps_equal_the_unpadded_forward(tmp_path, packed_on_cpu, kind, pooling_type):
    if kind == "qwen3":
        model_dir, vocab = save_tiny_decoder(tmp_path / kind, "Qwen3Config", "Qwen3Model", head_dim=16), 256
    elif kind.startswith("modernbert"):
        settings = dict(classifier_pooling="mean", num_labels=3)
        model_dir = save_tiny_modernbert(tmp_path / kind, "ModernBertForSequenceClassification", **settings)
        vocab = 30522
    else:
        labels = {"num_labels": 3} if kind == "bert-classifier" else {}
        model_class = "BertForSequenceClassification" if labels else "BertModel"
        model_dir, vocab = save_tiny_encoder(tmp_path / kind, model_class, **labels), 30522
    runner = _runner(model_dir, pooling_type, max_num_batched_tokens=256, max_num_seqs=24, max_model_len=200)
    assert isinstance(runner.graphs, EagerPoolingSteps)
    with torch.inference_mode():
        for prompts in _batches(vocab):
            padded = runner.launch_step(_step(prompts)).pooled
            lengths = [len(p) for p in prompts]
            key = runner.graphs.key(sum(lengths), max(lengths), len(lengths))
            assert key in runner.graphs.outputs
            if pooling_type == "mean" and key[0] > sum(lengths):  # the padding rows' seat: NaN, dropped
                assert torch.isnan(runner.graphs.outputs[key][len(lengths)]).all()
            graphs, runner.graphs = runner.graphs, None
            unpadded = runner.launch_step(_step(prompts)).pooled  # packed, no padding
            runner.packs = False
            grouped = runner.launch_step(_step(prompts)).pooled  # SDPA per group: the reference path
            runner.graphs, runner.packs = graphs, True
            assert torch.isfinite(padded).all()
            assert torch.allclose(padded, unpadded, rtol=1e-5, atol=1e-6)
            assert torch.allclose(padded, grouped, rtol=1e-5, atol=1e-5)


def test_embed_through_the_padded_steps_equals_the_grouped_path(tmp_path, monkeypatch):
    """LLM.embed (pooling batches: slices beside single requests) through the padded steps; and
    --enforce-eager keeps every step unpadded."""
    sentences = mixed_sentences(40)
    model_dir = save_tiny_encoder(tmp_path / "bert", "BertModel")
    results = []
    for packs, eager in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(bert, "varlen_attention", _kernel_stand_in)
        monkeypatch.setattr(pooling_runner, "packs_inputs", lambda *_, packs=packs: packs)
        llm = LLM(str(model_dir), device="cpu", enforce_eager=eager, max_num_batched_tokens=1024)
        try:
            runner = llm.engine.core.executor.runner
            assert (runner.graphs is not None) == (packs and not eager)
            results.append(np.array([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)]))
            if runner.graphs is not None:
                assert runner.graphs.outputs  # the steps went through the padded path
        finally:
            llm.shutdown()
    assert np.allclose(results[1], results[0], atol=1e-5) and np.allclose(results[2], results[0], atol=1e-5)
