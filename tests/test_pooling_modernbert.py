"""ModernBERT offline (`LLM.embed / encode / classify / score`) against transformers, fp32 on the
CPU at tp 1 and tp 2: tiny random checkpoints (4 layers, two of them local with a window of 8
each side) made by transformers, inputs of mixed lengths in one batch, most longer than the
window; and the packed (FlashAttention) path's windowed packing against the grouped one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.pooling import mixed_sentences, save_tiny_modernbert
from zllm import LLM

ATOL = 2e-5  # fp32, different summation orders
WINDOW = 8  # save_tiny_modernbert's local_attention // 2
PAIRS = [
    ("what is a fox", "a fox is a small wild animal of the dog family"),
    ("what is a fox", "cars are fast"),
    ("short", "a much longer document about something else entirely, with many more words in it than the query"),
]


def _hf(model_dir, model_class: str, **config):
    import transformers

    return getattr(transformers, model_class).from_pretrained(model_dir, dtype=torch.float32, **config).eval()


def _normalized(vectors) -> np.ndarray:
    vectors = np.asarray(vectors)
    return vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return save_tiny_modernbert(tmp_path_factory.mktemp("modernbert"), "ModernBertModel")


@pytest.mark.parametrize("tp", [1, 2])
def test_modernbert_embeddings_equal_transformers(encoder_dir, tp):
    texts = mixed_sentences(9)
    llm = LLM(str(encoder_dir), device="cpu", tensor_parallel_size=tp)
    try:
        tokenizer = llm.get_tokenizer()
        embedded = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        raw = np.array([o.outputs.data for o in llm.encode(texts, use_tqdm=False)])
    finally:
        llm.shutdown()
    tokens = [tokenizer(t, return_tensors="pt") for t in texts]
    assert min(len(t.input_ids[0]) for t in tokens) <= WINDOW < 3 * WINDOW < max(len(t.input_ids[0]) for t in tokens)
    hf, unwindowed = _hf(encoder_dir, "ModernBertModel"), _hf(encoder_dir, "ModernBertModel", local_attention=4096)
    with torch.inference_mode():
        reference = np.array([hf(**t).last_hidden_state[0, 0].numpy() for t in tokens])
        without_window = np.array([unwindowed(**t).last_hidden_state[0, 0].numpy() for t in tokens])
    assert np.abs(reference - without_window).max() > 1e-2  # the window matters
    assert np.allclose(raw, reference, atol=ATOL)  # no modules.json: CLS, normalized (as vLLM's)
    assert np.allclose(embedded, _normalized(reference), atol=ATOL)


def test_modernbert_masked_lm_checkpoint_serves_its_encoder(tmp_path):
    """ModernBERT-base/large ship as ModernBertForMaskedLM: the encoder is served, the head left."""
    model_dir = save_tiny_modernbert(tmp_path / "mlm", "ModernBertForMaskedLM")
    prompts = [[101, 7, 2000, 102], [101, *range(1000, 1060), 102]]
    with LLM(str(model_dir), device="cpu") as llm:
        raw = [o.outputs.data for o in llm.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)]
    hf = _hf(model_dir, "ModernBertForMaskedLM")
    with torch.inference_mode():
        reference = [hf.model(torch.tensor([p])).last_hidden_state[0, 0].numpy() for p in prompts]
    assert np.allclose(raw, reference, atol=ATOL)


# Mean pooling with every bias and norm bias on; and CLS pooling, one label (a cross-encoder).
CLASSIFIERS = {
    "mean": dict(
        classifier_pooling="mean",
        num_labels=3,
        norm_bias=True,
        attention_bias=True,
        mlp_bias=True,
        classifier_bias=True,
    ),
    "cls": dict(classifier_pooling="cls", num_labels=1),
}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["mean", "cls"])
def test_modernbert_classifiers_equal_transformers(tmp_path, kind, tp):
    model_dir = save_tiny_modernbert(tmp_path / kind, "ModernBertForSequenceClassification", **CLASSIFIERS[kind])
    hf = _hf(model_dir, "ModernBertForSequenceClassification")
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=tp)
    try:
        tokenizer = llm.get_tokenizer()
        if kind == "mean":
            texts = mixed_sentences(7)
            ours = np.array([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
        else:
            scores = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)
            ours = np.array([s.outputs.score for s in scores])
    finally:
        llm.shutdown()
    with torch.inference_mode():
        if kind == "mean":
            logits = torch.stack([hf(**tokenizer(t, return_tensors="pt")).logits[0] for t in texts])
            reference = torch.softmax(logits, -1).numpy()
        else:
            logits = torch.stack([hf(**tokenizer(a, b, return_tensors="pt")).logits[0, 0] for a, b in PAIRS])
            reference = torch.sigmoid(logits).numpy()
    assert np.allclose(ours, reference, atol=ATOL)
    assert np.ptp(reference, axis=0).max() > 1e-3  # the inputs matter


def _reference_varlen(q, k, v, packed, causal, scale, window=None):
    """What FlashAttention's variable-length kernel computes with window_size (window - 1 each
    side), input by input (a CPU stand-in); rows of no input stay NaN (not computed)."""
    bounds = packed.cu_seqlens.tolist()
    out = torch.full_like(q, float("nan"))
    for start, stop in zip(bounds, bounds[1:]):
        if stop <= start:
            continue
        qi, ki, vi = (t[start:stop].transpose(0, 1) for t in (q, k, v))
        mask = None
        if window is not None:
            columns = torch.arange(stop - start)
            mask = (columns[:, None] - columns[None, :]).abs() <= window - 1
        attended = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:stop] = attended.transpose(0, 1)
    return out.reshape(q.shape[0], -1)


def test_the_packed_flash_path_applies_the_window_as_the_grouped_path_does(encoder_dir, monkeypatch):
    from zllm.workers import pooling_runner
    from zllm.workers.models import modernbert

    monkeypatch.setattr(modernbert, "varlen_attention", _reference_varlen)
    sentences = mixed_sentences(12)
    results = []
    for packs in (False, True):
        monkeypatch.setattr(pooling_runner, "packs_inputs", lambda *_, packs=packs: packs)
        with LLM(str(encoder_dir), device="cpu") as llm:
            assert llm.engine.core.executor.runner.packs is packs
            results.append([o.outputs.embedding for o in llm.embed(sentences, use_tqdm=False)])
    assert np.allclose(results[0], results[1], atol=1e-5)


def test_a_transformers_4_config_gives_the_same_spec(encoder_dir):
    """transformers 4.x's ModernBertConfig (global_attn_every_n_layers, global/local_rope_theta;
    no layer_types, no rope_parameters) reads as the 5.x one transformers wrote."""
    import json
    from types import SimpleNamespace

    from zllm.model_spec import ModelSpec

    written = json.loads((encoder_dir / "config.json").read_text())
    old = {k: v for k, v in written.items() if k not in ("layer_types", "rope_parameters")}
    old.update(global_attn_every_n_layers=2, global_rope_theta=160000.0, local_rope_theta=10000.0)
    old_spec = ModelSpec.from_hf_config(SimpleNamespace(**old))
    spec = ModelSpec.from_pretrained(str(encoder_dir))
    assert (spec.sliding_layers, spec.sliding_window) == ((1, 3), WINDOW + 1)
    assert (spec.rope_theta, spec.local_rope_theta) == (160000.0, 10000.0)
    assert old_spec == spec
