"""Tiny random Llama checkpoints made with transformers' own classes: the engine's greedy tokens
equal HF generate exactly (fp32, CPU) — plain, Llama-3 rope-scaled, tied embeddings, sharded."""

from __future__ import annotations

import pytest

from tests.conftest import save_tiny_llama
from zllm import LLMEngine, SamplingParams
from zllm.workers.loader import checkpoint_files

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
PROMPTS = [[5, 9, 13], list(range(3, 40)), [7] * 5 + list(range(100, 140)), [250, 251, 3, 4, 5, 6, 7, 8, 9, 10]]


def _hf_generate_all(model_dir, prompts, max_new_tokens):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import hf_greedy

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, p, max_new_tokens, eos_token_id=None) for p in prompts]


def _engine_generate_all(model_dir, prompts, max_new_tokens, **engine_args):
    engine = LLMEngine.from_engine_args(str(model_dir), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [results[str(i)] for i in range(len(prompts))]


def _tokenizer_files(directory):
    """The engine's frontend needs a tokenizer; any fast tokenizer over the tiny vocab will do."""
    from benchmarks.dummy_model import write_placeholder_tokenizer

    write_placeholder_tokenizer(directory)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0},
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 4, "head_dim": 32},
    ],
    ids=["plain", "llama3-rope", "tied", "mha-head-dim"],
)
def test_tiny_llama_matches_hf(tmp_path, overrides):
    model_dir = save_tiny_llama(tmp_path, initializer_range=0.2, **overrides)
    _tokenizer_files(model_dir)
    expected = _hf_generate_all(model_dir, PROMPTS, 20)
    assert _engine_generate_all(model_dir, PROMPTS, 20) == expected
    # A block size of 8 puts every prompt but the first across several blocks.
    assert _engine_generate_all(model_dir, PROMPTS, 20, block_size=8) == expected


def test_sharded_checkpoint_equals_single_file(tmp_path):
    single = save_tiny_llama(tmp_path / "single", initializer_range=0.2)
    sharded = save_tiny_llama(tmp_path / "sharded", shards=3, initializer_range=0.2)
    _tokenizer_files(single)
    _tokenizer_files(sharded)
    assert len(checkpoint_files(str(sharded))) >= 2
    assert _engine_generate_all(sharded, PROMPTS, 12) == _engine_generate_all(single, PROMPTS, 12)


def test_dummy_weights_run_any_shape(tmp_path):
    model_dir = save_tiny_llama(tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    _tokenizer_files(model_dir)
    (tokens,) = _engine_generate_all(model_dir, PROMPTS[:1], 5, load_format="dummy")
    assert len(tokens) == 5 and all(0 <= t < 256 for t in tokens)
