"""Pooling models on a GPU (skipped without one): the real all-MiniLM-L6-v2 in half precision
against sentence-transformers in fp32 on the same GPU, tiny random decoders (Qwen3Model, a
sequence classifier) and ModernBERT encoders (FlashAttention's window in the local layers) in
bf16/fp16 against transformers in fp32, pipelined (async) steps equal to synchronous ones, a step
that never waits for the device before its vectors are read, and the pooling CUDA graphs
(zllm/workers/pooling_graphs.py) against the same padded steps run eagerly and against
--enforce-eager, over steps that cross the buckets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.pooling import minilm_dir, mixed_sentences, save_tiny_decoder, save_tiny_modernbert
from zllm import LLM

pytestmark = pytest.mark.gpu

# Token ids within the tiny decoders' 256-word vocabulary, lengths 1 to 393.
PROMPTS = [[5, 17, 200, 3], list(range(3, 90)), list(range(100, 141)), [9], [3 + i % 250 for i in range(393)]]


@pytest.fixture(autouse=True)
def _pooling_graphs_on(monkeypatch):
    """The pooling CUDA graphs are opt-in (ZLLM_POOLING_CUDA_GRAPHS); these tests check them too."""
    monkeypatch.setenv("ZLLM_POOLING_CUDA_GRAPHS", "1")


def _cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_minilm_on_the_gpu_equals_sentence_transformers(dtype):
    from sentence_transformers import SentenceTransformer

    sentences = mixed_sentences(300)
    reference = SentenceTransformer(minilm_dir(), device="cuda").encode(sentences, convert_to_numpy=True)
    llm = LLM(minilm_dir(), dtype=dtype)
    try:
        ours = [o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert _cosines(ours, reference).min() >= (0.99999 if dtype == "float32" else 0.999)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_qwen3_model_bf16_on_the_gpu_equals_transformers(tmp_path, async_scheduling):
    model_dir = save_tiny_decoder(tmp_path / "q3", "Qwen3Config", "Qwen3Model", head_dim=64, hidden_size=256)
    llm = LLM(str(model_dir), dtype="bfloat16", async_scheduling=async_scheduling, max_num_batched_tokens=512)
    try:
        ours = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)]
    finally:
        llm.shutdown()
    import transformers

    hf = transformers.Qwen3Model.from_pretrained(model_dir, dtype=torch.float32).eval().cuda()
    with torch.inference_mode():
        reference = [hf(torch.tensor([p], device="cuda")).last_hidden_state[0, -1].cpu().numpy() for p in PROMPTS]
    assert _cosines(ours, reference).min() >= 0.999


def test_decoder_classifier_bf16_on_the_gpu(tmp_path):
    """fp32 equals transformers' fp32; bf16 stays as close to it as transformers' own bf16 does
    (a random tiny classifier's softmax moves by a few hundredths in bf16: 0.046 for HF, 0.044
    for ours on an H100)."""
    import transformers

    model_dir = save_tiny_decoder(tmp_path / "cls", "Qwen2Config", "Qwen2ForSequenceClassification", num_labels=3)

    def hf_probs(dtype: torch.dtype) -> np.ndarray:
        hf = transformers.Qwen2ForSequenceClassification.from_pretrained(model_dir, dtype=dtype).eval().cuda()
        with torch.inference_mode():
            logits = [hf(torch.tensor([p], device="cuda")).logits[0].float() for p in PROMPTS]
        return np.array([torch.softmax(x, -1).cpu().numpy() for x in logits])

    def our_probs(dtype: str) -> np.ndarray:
        llm = LLM(str(model_dir), dtype=dtype)
        try:
            return np.array([o.outputs.probs for o in llm.classify([{"prompt_token_ids": p} for p in PROMPTS])])
        finally:
            llm.shutdown()

    reference = hf_probs(torch.float32)
    assert np.abs(our_probs("float32") - reference).max() < 1e-5
    hf_bf16_error = np.abs(hf_probs(torch.bfloat16) - reference).max()
    assert np.abs(our_probs("bfloat16") - reference).max() <= max(1.5 * hf_bf16_error, 1e-3)


# ModernBERT with head_dim 64 (FlashAttention's packed path in half precision), a window of 8
# each side in layers 1 and 3; ids within the MiniLM tokenizer's vocabulary, lengths 1 to 393.
MODERNBERT = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4)
MODERNBERT_PROMPTS = [[101, *(1000 + (7 * i) % 20000 for i in range(n)), 102] for n in (2, 87, 41, 0, 391)]


def _modernbert_outputs(model_dir, dtype: str, run: str) -> np.ndarray:
    llm = LLM(str(model_dir), dtype=dtype)
    try:
        assert llm.engine.core.executor.runner.packs is (dtype != "float32")  # FlashAttention's window
        inputs = [{"prompt_token_ids": p} for p in MODERNBERT_PROMPTS]
        if run == "encode":
            return np.array([o.outputs.data for o in llm.encode(inputs, use_tqdm=False)])
        return np.array([o.outputs.probs for o in llm.classify(inputs, use_tqdm=False)])
    finally:
        llm.shutdown()


def _hf_modernbert(model_dir, model_class: str, dtype: torch.dtype) -> np.ndarray:
    """transformers' CLS hidden states (ModernBertModel) or class probabilities, on the GPU."""
    import transformers

    model = getattr(transformers, model_class).from_pretrained(model_dir, dtype=dtype).eval().cuda()
    with torch.inference_mode():
        outputs = [model(torch.tensor([p], device="cuda")) for p in MODERNBERT_PROMPTS]
    if model_class == "ModernBertModel":
        return np.array([o.last_hidden_state[0, 0].float().cpu().numpy() for o in outputs])
    return np.array([torch.softmax(o.logits[0].float(), -1).cpu().numpy() for o in outputs])


def test_modernbert_on_the_gpu_equals_transformers(tmp_path):
    """CLS hidden states: fp32 (SDPA under the band mask) equals transformers' fp32; bf16 and
    fp16 (FlashAttention with window_size) stay as close to it as transformers' own bf16 / fp16
    (a random tiny model's bf16 CLS vector is ~1e-3 off in cosine for both on the CPU; without
    the window it would be far off)."""
    model_dir = save_tiny_modernbert(tmp_path / "mb", "ModernBertModel", **MODERNBERT)
    reference = _hf_modernbert(model_dir, "ModernBertModel", torch.float32)
    assert np.abs(_modernbert_outputs(model_dir, "float32", "encode") - reference).max() < 1e-4
    for dtype in ("bfloat16", "float16"):
        hf_error = 1 - _cosines(_hf_modernbert(model_dir, "ModernBertModel", getattr(torch, dtype)), reference).min()
        our_error = 1 - _cosines(_modernbert_outputs(model_dir, dtype, "encode"), reference).min()
        assert our_error <= max(2 * hf_error, 1e-5), (dtype, our_error, hf_error)


def test_modernbert_mean_pooled_classifier_bf16_on_the_gpu(tmp_path):
    """fp32 equals transformers' fp32; bf16 stays about as close to it as transformers' own bf16
    (on the CPU: 0.021 for ours, 0.013 for HF's, random tiny classifier, 5 inputs)."""
    model_dir = save_tiny_modernbert(
        tmp_path / "mbc",
        "ModernBertForSequenceClassification",
        classifier_pooling="mean",
        num_labels=3,
        **MODERNBERT,
    )
    classifier = "ModernBertForSequenceClassification"
    reference = _hf_modernbert(model_dir, classifier, torch.float32)
    assert np.abs(_modernbert_outputs(model_dir, "float32", "classify") - reference).max() < 1e-5
    hf_bf16_error = np.abs(_hf_modernbert(model_dir, classifier, torch.bfloat16) - reference).max()
    our_error = np.abs(_modernbert_outputs(model_dir, "bfloat16", "classify") - reference).max()
    assert our_error <= max(2 * hf_bf16_error, 1e-3), (our_error, hf_bf16_error)


def test_minilm_batches_on_the_gpu_equal_one_request_each():
    """The offline pooling batches (slices of arrays) against the per-request path, fp16."""
    sentences = mixed_sentences(300)
    llm = LLM(minilm_dir(), dtype="float16", max_num_batched_tokens=2048, max_num_seqs=64)
    try:
        batched = llm.embed(sentences, use_tqdm=False)
        llm._batchable = lambda prompts: False
        one_by_one = llm.embed(sentences, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.prompt_token_ids for o in batched] == [o.prompt_token_ids for o in one_by_one]
    assert _cosines([o.outputs.embedding for o in batched], [o.outputs.embedding for o in one_by_one]).min() >= 0.9999


def test_a_pooling_step_never_waits_for_the_device():
    import msgspec

    from zllm.config import EngineConfig
    from zllm.ipc.messages import ArrayData, NewRequestData, PoolingSlice, StepInput
    from zllm.pooling import POOLING_SAMPLING, PoolingParams
    from zllm.workers.pooling_runner import PoolingRunner

    config = EngineConfig.create(minilm_dir(), dtype="float16")
    runner = PoolingRunner(config, torch.device("cuda"))
    runner.load_model()
    requests = [
        NewRequestData(str(i), len(p) + 2, [101, *p, 102], POOLING_SAMPLING, [], 0)
        for i, p in enumerate([[2000 + j for j in range(n)] for n in (3, 50, 120, 7)])
    ]
    step = StepInput(1, requests, [], [r.request_id for r in requests], [len(r.token_ids) for r in requests])
    runner.finish_step(runner.launch_step(step))  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = runner.launch_step(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(runner.finish_step(launched).pooled) == 4
    # With a slice of a pooling batch beside the requests (its inputs sorted in among theirs).
    lengths = np.array([40, 2, 77], dtype=np.int32)
    ids = ArrayData.of(np.full(int(lengths.sum()), 2001, dtype=np.int32))
    step = msgspec.structs.replace(
        step, pooling_slices=[PoolingSlice("b", 5, ids, ArrayData.of(lengths), PoolingParams())]
    )
    runner.finish_step(runner.launch_step(step))  # warm-up
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = runner.launch_step(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    output = runner.finish_step(launched)
    (answer,) = output.pooled_slices
    assert len(output.pooled) == 4 and (answer.batch_id, answer.first, answer.vectors.shape) == ("b", 5, [3, 384])


# ---- CUDA graphs for pooling steps ------------------------------------------------------------------

# Step shapes (input lengths) crossing the token buckets (16/17, 128/129, ...), the longest-input
# bounds (64/65, 256) and the seats (64 inputs at max_num_seqs=64); every step fits 2,048 tokens.
GRAPH_STEPS = [[1], [16], [17], [5, 3, 9], [64, 65], [128], [129], [200, 56], [7] * 63, [3] * 64, [250] * 8, [40, 1, 2]]


def _graph_runner(model_dir, dtype: str, capture: bool, **engine_args):
    from zllm.config import EngineConfig
    from zllm.workers.pooling_runner import PoolingRunner

    limits = dict(max_num_batched_tokens=2048, max_num_seqs=64) | engine_args
    runner = PoolingRunner(EngineConfig.create(str(model_dir), dtype=dtype, **limits), torch.device("cuda"))
    runner.load_model()
    if capture:
        runner.capture_graphs()
    return runner


def _graph_step(step_id: int, lengths: list[int], vocab: tuple[int, int], seed: int = 0):
    from zllm.ipc.messages import NewRequestData, StepInput
    from zllm.pooling import POOLING_SAMPLING

    rng = np.random.default_rng([seed, step_id])
    prompts = [rng.integers(*vocab, size=n).tolist() for n in lengths]
    requests = [
        NewRequestData(f"{step_id}-{i}", n, p, POOLING_SAMPLING, [], 0)
        for i, (n, p) in enumerate(zip(lengths, prompts))
    ]
    return StepInput(step_id, requests, [], [r.request_id for r in requests], lengths)


def _vectors(runner, step) -> np.ndarray:
    output = runner.finish_step(runner.launch_step(step))
    return np.array([np.frombuffer(output.pooled[r.request_id], dtype="<f4") for r in step.new_requests])


def _graph_models(tmp_path):
    """(name, directory, dtype, token-id range): the real MiniLM (mean pooling), a tiny BERT
    classifier (its head on the CLS row), tiny Qwen3 embedders (last token) in both half types."""
    from tests.helpers.pooling import save_tiny_encoder

    classifier = save_tiny_encoder(  # head_dim 32: FlashAttention's sizes start there
        tmp_path / "bert-cls", "BertForSequenceClassification", num_labels=3, hidden_size=128, intermediate_size=256
    )
    qwen3 = save_tiny_decoder(tmp_path / "q3", "Qwen3Config", "Qwen3Model", head_dim=64, hidden_size=256)
    return [
        ("minilm", minilm_dir(), "float16", (1000, 30000)),
        ("bert-classifier", classifier, "float16", (1000, 30000)),
        ("qwen3-bf16", qwen3, "bfloat16", (3, 256)),
        ("qwen3-fp16", qwen3, "float16", (3, 256)),
    ]


def test_pooling_graphs_replay_what_the_padded_steps_compute(tmp_path):
    """A graph's replay against the same padded step run eagerly (same shapes, same kernels):
    equal up to what a kernel's own choices may change (a cuBLAS workspace of the capture
    stream's); every step replays a graph."""
    from zllm.workers.pooling_graphs import EagerPoolingSteps, PoolingGraphs

    for name, model_dir, dtype, vocab in _graph_models(tmp_path):
        runner = _graph_runner(model_dir, dtype, capture=True)
        assert isinstance(runner.graphs, PoolingGraphs), name
        graphs = runner.graphs
        eager = EagerPoolingSteps(runner.model, runner.pooling_type, 2048, 64, runner.config.max_model_len)
        for index, lengths in enumerate(GRAPH_STEPS):
            step = _graph_step(index, lengths, vocab)
            assert graphs.key(sum(lengths), max(lengths), len(lengths)) is not None, (name, lengths)
            replayed = _vectors(runner, step)
            runner.graphs = eager
            padded = _vectors(runner, step)
            runner.graphs = graphs
            assert np.isfinite(replayed).all(), (name, lengths)
            assert np.abs(replayed - padded).max() <= 1e-2 * np.abs(padded).max(), (name, lengths)
        del runner, graphs, eager
        torch.cuda.empty_cache()


def test_pooling_graphs_equal_enforce_eager(tmp_path):
    """Graphs on (padded steps) against --enforce-eager (unpadded packed steps): the padding
    changes no input's vector beyond half precision's rounding (the GEMMs see more rows)."""
    for name, model_dir, dtype, vocab in _graph_models(tmp_path):
        graphed = _graph_runner(model_dir, dtype, capture=True)
        eager = _graph_runner(model_dir, dtype, capture=True, enforce_eager=True)
        assert graphed.graphs is not None and eager.graphs is None, name
        for index, lengths in enumerate(GRAPH_STEPS):
            step = _graph_step(index, lengths, vocab)
            ours, reference = _vectors(graphed, step), _vectors(eager, step)
            assert np.isfinite(ours).all(), (name, lengths)
            assert _cosines(ours, reference).min() >= 0.9999, (name, lengths)
            scale = np.abs(reference).max()
            assert np.abs(ours - reference).max() <= 2e-2 * scale, (name, lengths)
        del graphed, eager
        torch.cuda.empty_cache()


def test_fp32_pooling_steps_stay_eager():
    """fp32 attends per group through SDPA (groups sized on the host): no graphs."""
    runner = _graph_runner(minilm_dir(), "float32", capture=True)
    assert not runner.packs and runner.graphs is None


def test_pipelined_graph_steps_keep_their_own_vectors():
    """Under async scheduling step N+1 replays the same graph before step N's vectors are read:
    each step's vectors are a copy, not the graph's output rows."""
    runner = _graph_runner(minilm_dir(), "float16", capture=True)
    steps = [_graph_step(i, [30, 12, 50], (1000, 30000), seed=i) for i in range(4)]
    alone = [_vectors(runner, step) for step in steps]
    launched = [runner.launch_step(step) for step in steps]  # all four queued before any is read
    for step, one, expected in zip(steps, launched, alone):
        output = runner.finish_step(one)
        got = np.array([np.frombuffer(output.pooled[r.request_id], dtype="<f4") for r in step.new_requests])
        # Mean pooling sums each input's rows with index_add_, whose CUDA atomics add in any order:
        # the same step gives its vectors within fp32 rounding, not bit for bit (seen: 1 element of
        # 1152 one ulp off). A vector read from another step's rows would differ entirely.
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert not np.allclose(alone[0], alone[1], rtol=1e-2)  # the steps differ, so a shared buffer would show


def test_a_graph_step_never_waits_for_the_device():
    from zllm.workers.pooling_graphs import PoolingGraphs

    runner = _graph_runner(minilm_dir(), "float16", capture=True)
    assert isinstance(runner.graphs, PoolingGraphs)
    step = _graph_step(0, [3, 50, 120, 7], (1000, 30000))
    runner.finish_step(runner.launch_step(step))  # warm-up (pinned staging buffers)
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = runner.launch_step(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(runner.finish_step(launched).pooled) == 4


def test_minilm_with_graphs_equals_sentence_transformers_across_buckets():
    """LLM.embed (pooling batches in slices) with graphs on, many step sizes: each chunk of
    sentences is its own call, so the last step of each lands in a different bucket."""
    from sentence_transformers import SentenceTransformer

    sentences = mixed_sentences(300)
    reference = SentenceTransformer(minilm_dir(), device="cuda").encode(sentences, convert_to_numpy=True)
    llm = LLM(minilm_dir(), dtype="float16", max_num_batched_tokens=2048, max_num_seqs=64)
    try:
        from zllm.workers.pooling_graphs import PoolingGraphs

        assert isinstance(llm.engine.core.executor.runner.graphs, PoolingGraphs)
        ours = []
        for first, size in ((0, 1), (1, 2), (3, 17), (20, 45), (65, 235)):
            ours += [o.outputs.embedding for o in llm.embed(sentences[first : first + size], use_tqdm=False)]
    finally:
        llm.shutdown()
    assert _cosines(ours, reference).min() >= 0.999


def test_pooling_graphs_at_tp2_equal_enforce_eager():
    """Two ranks capture the same graphs (all-reduces inside them) and replay the same ones."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    sentences = mixed_sentences(120)
    results = []
    for eager in (False, True):
        llm = LLM(
            minilm_dir(),
            dtype="float16",
            tensor_parallel_size=2,
            enforce_eager=eager,
            max_num_batched_tokens=2048,
            max_num_seqs=64,
        )
        try:
            results.append([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert _cosines(results[0], results[1]).min() >= 0.9999
