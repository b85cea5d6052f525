"""Pooling models offline (`LLM.embed / score / classify / encode`) against their references, fp32
on the CPU: the real all-MiniLM-L6-v2 against sentence-transformers, tiny random BERT and
XLM-RoBERTa encoders and cross-encoders (made by transformers) against transformers' outputs, at
tp 1 and tp 2; the pooling scheduler step by step; and the inputs a pooling engine refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers.models import save_tiny_model
from tests.helpers.pooling import minilm_dir, mixed_sentences, save_tiny_decoder, save_tiny_encoder
from zllm import LLM, PoolingParams, SamplingParams
from zllm.config import EngineConfig
from zllm.enginecore.block_pool import BlockPool
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.pooling_scheduler import PoolingScheduler
from zllm.enginecore.request import Request
from zllm.ipc.messages import StepOutput

ATOL = 2e-5  # fp32, different summation orders
PAIRS = [
    ("what is a fox", "a fox is a small wild animal of the dog family"),
    ("what is a fox", "cars are fast"),
    ("how do embeddings help retrieval", "nearest passages are found by the cosine of their vectors"),
    ("short", "a much longer document about something else entirely, with many more words in it than the query"),
]


@pytest.fixture(scope="module")
def minilm():
    llm = LLM(minilm_dir(), device="cpu")
    yield llm
    llm.shutdown()


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_minilm_embeddings_equal_sentence_transformers(minilm):
    from sentence_transformers import SentenceTransformer

    sentences = mixed_sentences(72)
    lengths = [len(minilm.get_tokenizer().encode(s)) for s in sentences]
    assert min(lengths) <= 4 and max(lengths) >= 100  # mixed lengths, one engine step for many
    reference = SentenceTransformer(minilm_dir(), device="cpu").encode(sentences, convert_to_numpy=True)
    steps_before = minilm.engine.core.stats().num_steps
    ours = np.array([o.outputs.embedding for o in minilm.embed(sentences, use_tqdm=False)])
    # Many inputs share a step: as many steps as the token budget (2048) needs, not one per input.
    steps = minilm.engine.core.stats().num_steps - steps_before
    assert steps <= -(-sum(lengths) // 2048) + 1 < len(sentences) // 10
    assert ours.shape == reference.shape == (72, 384)
    assert _cosines(ours, reference).min() >= 0.99999
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)  # the model's Normalize module


def test_pipelined_steps_give_the_same_embeddings(minilm):
    # Async scheduling (on by default with CUDA): step N+1 is scheduled and launched before step
    # N is answered; a small budget makes many steps.
    sentences = mixed_sentences(40)
    llm = LLM(minilm_dir(), device="cpu", async_scheduling=True, max_num_batched_tokens=300, max_num_seqs=8)
    try:
        pipelined = [o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert np.allclose(pipelined, [o.outputs.embedding for o in minilm.embed(sentences, use_tqdm=False)], atol=1e-6)


def test_minilm_token_ids_encode_and_bi_encoder_score(minilm):
    tokenizer = minilm.get_tokenizer()
    text = "embeddings from token ids"
    by_text = minilm.embed(text, use_tqdm=False)[0].outputs.embedding
    by_ids = minilm.embed({"prompt_token_ids": tokenizer.encode(text)}, use_tqdm=False)[0].outputs.embedding
    assert by_text == by_ids
    raw = minilm.encode(text, use_tqdm=False)[0].outputs.data  # mean-pooled, not normalized
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-3
    assert np.allclose(np.array(raw) / np.linalg.norm(raw), by_text, atol=1e-6)
    scores = minilm.score(PAIRS[0][0], [PAIRS[0][1], PAIRS[1][1]], use_tqdm=False)
    first, second = (s.outputs.score for s in scores)
    assert first > second  # the fox is about the fox
    vectors = [o.outputs.embedding for o in minilm.embed([PAIRS[0][0], PAIRS[0][1]], use_tqdm=False)]
    assert first == pytest.approx(float(np.dot(*vectors)), abs=1e-6)


def test_batch_token_ids_equal_the_tokenizers_own_call():
    from transformers import AutoTokenizer

    from zllm.frontend.tokenizer import batch_token_ids

    texts = [*mixed_sentences(30), "héllo wörld, ünïcode 東京", "a"]
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    # Fresh from tokenizer.json, the Rust backend truncates and pads to 128: the fallback runs.
    assert tokenizer._tokenizer.truncation is not None
    assert batch_token_ids(tokenizer, texts) == tokenizer(texts)["input_ids"]
    assert tokenizer._tokenizer.truncation is None  # transformers' call cleared it: the fast path
    assert batch_token_ids(tokenizer, texts) == AutoTokenizer.from_pretrained(minilm_dir())(texts)["input_ids"]


def test_inputs_tokenized_in_chunks_beside_the_engine(minilm, monkeypatch):
    """Text, {"prompt": text} and token-id inputs mixed over several tokenizer chunks give the
    vectors each gives alone, in order; a bad input in a later chunk fails the call (the inputs
    of earlier chunks already in the engine are aborted) and the engine serves on."""
    import zllm.launch.llm as offline

    monkeypatch.setattr(offline, "_TOKENIZE_CHUNK", 3)
    tokenizer = minilm.get_tokenizer()
    sentences = mixed_sentences(10)
    prompts = [
        s if i % 3 == 0 else {"prompt": s} if i % 3 == 1 else {"prompt_token_ids": tokenizer.encode(s)}
        for i, s in enumerate(sentences)
    ]
    together = minilm.embed(prompts, use_tqdm=False)
    assert [o.prompt_token_ids for o in together] == [tokenizer.encode(s) for s in sentences]
    alone = [minilm.embed(s, use_tqdm=False)[0].outputs.embedding for s in sentences]
    assert np.allclose([o.outputs.embedding for o in together], alone, atol=1e-6)
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        minilm.embed([*sentences[:7], ""], use_tqdm=False)
    assert not minilm.engine.core.has_unfinished_requests()
    assert np.allclose(minilm.embed(sentences[0], use_tqdm=False)[0].outputs.embedding, alone[0], atol=1e-6)


def test_pooling_engine_refuses_what_it_cannot_serve(minilm):
    with pytest.raises(ValueError, match="task: this is a pooling model"):
        minilm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="input: 300 tokens exceed the model's maximum of 256"):
        minilm.embed({"prompt_token_ids": [1000] * 300}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts: must not be empty"):
        minilm.embed([], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
        minilm.embed("x", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="task: 'classify' is not served"):
        minilm.classify("x", use_tqdm=False)
    assert len(minilm.embed("still serving", use_tqdm=False)) == 1


def test_generative_model_refuses_pooling_requests(tmp_path):
    llm = LLM(str(save_tiny_model(tmp_path / "llama")), device="cpu", kv_cache_memory_bytes=8 << 20)
    try:
        with pytest.raises(ValueError, match="task: 'embed' needs a pooling model"):
            llm.embed("hello", use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="convert: classify: the LlamaForCausalLM checkpoint has no score.weight"):
        EngineConfig.create(str(tmp_path / "llama"), runner="pooling", convert="classify")


# ---- tiny random encoders against transformers ------------------------------------------------


def _hf(model_dir, model_class: str):
    import transformers

    return getattr(transformers, model_class).from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return save_tiny_encoder(tmp_path_factory.mktemp("bert-ce"), "BertForSequenceClassification", num_labels=1)


@pytest.mark.parametrize("tp", [1, 2])
def test_bert_cross_encoder_scores_equal_transformers(cross_encoder_dir, tp):
    hf = _hf(cross_encoder_dir, "BertForSequenceClassification")
    llm = LLM(str(cross_encoder_dir), device="cpu", tensor_parallel_size=tp)
    try:
        tokenizer = llm.get_tokenizer()
        ours = [s.outputs.score for s in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)]
    finally:
        llm.shutdown()
    with torch.inference_mode():
        reference = [torch.sigmoid(hf(**tokenizer(a, b, return_tensors="pt")).logits)[0, 0].item() for a, b in PAIRS]
    assert np.allclose(ours, reference, atol=ATOL)
    assert max(reference) - min(reference) > 1e-3  # the pairs' token types and texts matter


def _normalized(vectors) -> np.ndarray:
    vectors = np.asarray(vectors)
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_bert_model_cls_pooling_equals_transformers(tmp_path, tp):
    model_dir = save_tiny_encoder(tmp_path / "bert", "BertModel")  # no modules.json: CLS, normalized (vLLM's)
    hf = _hf(model_dir, "BertModel")
    texts = mixed_sentences(9)
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=tp)
    try:
        tokenizer = llm.get_tokenizer()
        embedded = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        raw = np.array([o.outputs.data for o in llm.encode(texts, use_tqdm=False)])
    finally:
        llm.shutdown()
    with torch.inference_mode():
        reference = np.array([hf(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0].numpy() for t in texts])
    assert np.allclose(raw, reference, atol=ATOL)
    assert np.allclose(embedded, _normalized(reference), atol=ATOL)


def test_matryoshka_dimensions_truncate_then_normalize(tmp_path):
    model_dir = save_tiny_encoder(tmp_path / "mrl", "BertModel", matryoshka_dimensions=[16, 32])
    llm = LLM(str(model_dir), device="cpu")
    try:
        raw = np.array(llm.encode("a nested embedding", use_tqdm=False)[0].outputs.data)
        short = llm.embed("a nested embedding", PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
        with pytest.raises(ValueError, match="dimensions: 65 exceeds the model's 64"):
            llm.embed("x", PoolingParams(dimensions=65), use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(short) == 16 and np.allclose(short, _normalized(raw[:16]), atol=1e-6)


# ---- decoders: last-token embeddings and sequence classifiers -------------------------------------

DECODER_PROMPTS = [[5, 17, 200, 3], list(range(3, 90)), list(range(100, 141)), [9]]


def _decoder_outputs(model_dir, tp: int, run: str, **engine_args):
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, **engine_args)
    try:
        inputs = [{"prompt_token_ids": p} for p in DECODER_PROMPTS]
        if run == "embed":
            return np.array([o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False)])
        return np.array([o.outputs.probs for o in llm.classify(inputs, use_tqdm=False)])
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_model_last_token_embeddings_equal_transformers(tmp_path, tp):
    model_dir = save_tiny_decoder(tmp_path / "qwen3", "Qwen3Config", "Qwen3Model", head_dim=16)
    ours = _decoder_outputs(model_dir, tp, "embed")
    hf = _hf(model_dir, "Qwen3Model")
    with torch.inference_mode():
        reference = [hf(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in DECODER_PROMPTS]
    assert np.allclose(ours, _normalized(reference), atol=ATOL)


@pytest.mark.parametrize("tp", [1, 2])
def test_bidirectional_decoder_embeddings_equal_transformers(tmp_path, tp):
    """gte-Qwen2's embedders (Qodo-Embed-1 and kin) are Qwen2Model checkpoints whose config says
    is_causal: false; transformers' mask builder reads that flag (checked: a causal mask given
    explicitly changes its output)."""
    import transformers

    model_dir = save_tiny_decoder(tmp_path / "gte", "Qwen2Config", "Qwen2Model", is_causal=False)
    ours = _decoder_outputs(model_dir, tp, "embed")
    hf = transformers.Qwen2Model.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = [hf(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in DECODER_PROMPTS]
        causal = [
            hf(torch.tensor([p]), attention_mask=torch.full((len(p), len(p)), -torch.inf).triu(1)[None, None])
            .last_hidden_state[0, -1]
            .numpy()
            for p in DECODER_PROMPTS
        ]
    assert np.abs(np.array(reference[:3]) - np.array(causal[:3])).max() > 1e-2  # the flag matters
    assert np.allclose(ours, _normalized(reference), atol=ATOL)


def test_a_bidirectional_decoder_cannot_generate(tmp_path):
    model_dir = save_tiny_decoder(tmp_path / "gte", "Qwen2Config", "Qwen2ForCausalLM", is_causal=False)
    with LLM(str(model_dir), device="cpu") as llm:  # a pooling model by itself
        assert len(llm.embed({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="is_causal: false"):
        LLM(str(model_dir), device="cpu", runner="generate")


@pytest.mark.parametrize(
    "config_class, model_class, num_labels, tp",
    [
        ("Qwen2Config", "Qwen2ForSequenceClassification", 3, 1),
        ("Qwen2Config", "Qwen2ForSequenceClassification", 3, 2),
        ("LlamaConfig", "LlamaForSequenceClassification", 1, 1),
        ("LlamaConfig", "LlamaForSequenceClassification", 1, 2),
    ],
)
def test_decoder_sequence_classifiers_equal_transformers(tmp_path, config_class, model_class, num_labels, tp):
    model_dir = save_tiny_decoder(tmp_path / "cls", config_class, model_class, num_labels=num_labels)
    ours = _decoder_outputs(model_dir, tp, "classify")
    hf = _hf(model_dir, model_class)
    with torch.inference_mode():
        logits = torch.stack([hf(torch.tensor([p])).logits[0] for p in DECODER_PROMPTS])
    reference = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)
    assert np.allclose(ours, reference.numpy(), atol=ATOL)


def test_a_sentence_transformers_decoder_is_a_pooling_model_by_itself(tmp_path):
    # Qwen3-Embedding ships as Qwen3ForCausalLM with sentence-transformers' modules: last-token
    # pooling (and here no Normalize module, so the raw hidden state).
    model_dir = save_tiny_model(tmp_path / "st-qwen3", "qwen3", head_dim=16)
    (model_dir / "modules.json").write_text(
        json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    (model_dir / "1_Pooling").mkdir()
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    ours = _decoder_outputs(model_dir, 1, "embed")
    hf = _hf(model_dir, "Qwen3ForCausalLM")
    with torch.inference_mode():
        reference = [hf.model(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in DECODER_PROMPTS]
    assert np.allclose(ours, reference, atol=ATOL)


def test_generative_decoder_served_as_an_embedding_model(tmp_path):
    model_dir = save_tiny_model(tmp_path / "qwen2", "qwen2")
    ours = _decoder_outputs(model_dir, 1, "embed", runner="pooling")
    hf = _hf(model_dir, "Qwen2ForCausalLM")
    with torch.inference_mode():
        reference = [hf.model(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in DECODER_PROMPTS]
    assert np.allclose(ours, _normalized(reference), atol=ATOL)


@pytest.mark.parametrize("tp", [1, 2])
def test_xlm_roberta_encoder_and_classifier_equal_transformers(tmp_path, tp):
    prompts = [[0, 5, 17, 2000, 2], list(range(3, 90)), [0] + list(range(500, 540)) + [2]]
    encoder_dir = save_tiny_encoder(tmp_path / "xlmr", "XLMRobertaModel")
    classifier_dir = save_tiny_encoder(tmp_path / "xlmr-cls", "XLMRobertaForSequenceClassification", num_labels=3)
    outputs = []
    for model_dir, run in ((encoder_dir, "encode"), (classifier_dir, "classify")):
        llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=tp)
        try:
            inputs = [{"prompt_token_ids": p} for p in prompts]
            if run == "encode":
                outputs.append([o.outputs.data for o in llm.encode(inputs, use_tqdm=False)])
            else:
                outputs.append([o.outputs.probs for o in llm.classify(inputs, use_tqdm=False)])
        finally:
            llm.shutdown()
    encoder, classifier = (
        _hf(encoder_dir, "XLMRobertaModel"),
        _hf(classifier_dir, "XLMRobertaForSequenceClassification"),
    )
    with torch.inference_mode():
        hidden = [encoder(torch.tensor([p])).last_hidden_state[0, 0].numpy() for p in prompts]
        probs = [torch.softmax(classifier(torch.tensor([p])).logits[0], -1).numpy() for p in prompts]
    assert np.allclose(outputs[0], hidden, atol=ATOL)
    assert np.allclose(outputs[1], probs, atol=ATOL)


def _reference_varlen(q, k, v, packed, causal, scale):
    """What FlashAttention's variable-length kernel computes, input by input (CPU stand-in). Rows
    of no input (a CUDA graph's padding, zllm/workers/pooling_graphs.py) stay zero here."""
    bounds = packed.cu_seqlens.tolist()
    out = torch.zeros_like(q)
    for start, stop in zip(bounds, bounds[1:]):
        if stop == start:
            continue
        qi, ki, vi = (t[start:stop].transpose(0, 1) for t in (q, k, v))
        repeat = qi.shape[0] // ki.shape[0]
        ki, vi = ki.repeat_interleave(repeat, 0), vi.repeat_interleave(repeat, 0)
        attended = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=scale)
        out[start:stop] = attended.transpose(0, 1)
    return out.reshape(q.shape[0], -1)


def test_the_packed_flash_path_computes_what_the_grouped_path_does(tmp_path, monkeypatch):
    # On a GPU in half precision the runner packs the inputs for FlashAttention's varlen kernel;
    # here a reference stands in for the kernel, so the packing around it is what is checked.
    from zllm.workers import pooling_runner
    from zllm.workers.models import bert, decoder_pooling

    monkeypatch.setattr(bert, "varlen_attention", _reference_varlen)
    monkeypatch.setattr(decoder_pooling, "varlen_attention", _reference_varlen)
    sentences = mixed_sentences(12)
    encoder = save_tiny_encoder(tmp_path / "bert", "BertModel")
    decoder = save_tiny_decoder(tmp_path / "q3", "Qwen3Config", "Qwen3Model", head_dim=16)
    for model_dir, inputs in ((encoder, sentences), (decoder, [{"prompt_token_ids": p} for p in DECODER_PROMPTS])):
        results = []
        for packs in (False, True):
            monkeypatch.setattr(pooling_runner, "packs_inputs", lambda *_, packs=packs: packs)
            llm = LLM(str(model_dir), device="cpu")
            try:
                assert llm.engine.core.executor.runner.packs is packs
                results.append([o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False)])
            finally:
                llm.shutdown()
        assert np.allclose(results[0], results[1], atol=1e-5)


# ---- the pooling scheduler ------------------------------------------------------------------------


def _pooling_scheduler(**limits) -> PoolingScheduler:
    config = EngineConfig(model="unused", max_model_len=256, runner="pooling", **limits)
    return PoolingScheduler(config, KVCacheManager(BlockPool(1), 16, False))


def _request(request_id: str, length: int) -> Request:
    return Request(request_id, list(range(5, 5 + length)), SamplingParams(max_tokens=1), pooling=PoolingParams())


def test_pooling_scheduler_packs_whole_inputs_and_keeps_nothing():
    scheduler = _pooling_scheduler(max_num_batched_tokens=64, max_num_seqs=3)
    for request_id, length in (("a", 12), ("b", 40), ("c", 9), ("d", 30), ("e", 5)):
        scheduler.add_request(_request(request_id, length))
    step = scheduler.schedule()
    assert step.scheduled_ids == ["a", "b", "c"] and step.num_scheduled_tokens == [12, 40, 9]  # max_num_seqs
    assert all(r.block_ids == [] and r.pooling is not None for r in step.new_requests)
    pooled = {rid: np.full(4, i, dtype="<f4").tobytes() for i, rid in enumerate(step.scheduled_ids)}
    deltas = scheduler.update_from_output(StepOutput(step.step_id, step.scheduled_ids, [], pooled=pooled))
    assert [(d.request_id, d.finish_reason, d.pooled) for d in deltas] == [(r, "stop", pooled[r]) for r in "abc"]
    assert not scheduler.running and set(scheduler.requests) == {"d", "e"}
    step = scheduler.schedule()
    assert step.scheduled_ids == ["d", "e"] and not step.finished_ids
    scheduler.abort_requests(["d"])
    deltas = scheduler.update_from_output(StepOutput(step.step_id, step.scheduled_ids, [], failed_requests={"e": "x"}))
    assert [(d.request_id, d.finish_reason, d.error) for d in deltas] == [("e", "error", "x")]
    assert not scheduler.has_unfinished_requests()


def test_pooling_scheduler_refuses_generation_and_inputs_over_the_budget():
    scheduler = _pooling_scheduler(max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="task: this is a pooling model"):
        scheduler.add_request(Request("g", [1, 2, 3], SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="input: 40 tokens exceed max_num_batched_tokens"):
        scheduler.add_request(_request("long", 40))
