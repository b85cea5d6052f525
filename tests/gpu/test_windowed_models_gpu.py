"""Gemma 2, Gemma 3 and Phi-3 on a GPU against HF transformers on the same GPU: random models made
by transformers (tests/helpers/models.py), sliding windows of 64 tokens under prompts of up to 400
(tests/gpu/conftest.py's prompt_ids), decode CUDA graphs on (the engine's default), the kernels'
window and soft-cap arguments inside them.

fp32 must give HF's tokens exactly; bf16 must agree on the prefill's answer of most prompts (the
sequences drift apart once a near-tie goes the other way, as in test_engine_gpu.py)."""

from __future__ import annotations

import os

import pytest

from tests.helpers.gpu import engine_tokens, hf_tokens, record, share_identical
from tests.helpers.models import save_tiny_model

pytestmark = pytest.mark.gpu

SHAPES = {
    # Gemma 2 2B's heads (8 of 256 dims over 4 KV heads): local and global layers, attention and
    # final logits soft-capped (caps a random model's scores reach), GeGLU, Gemma's norms,
    # query_pre_attn_scalar apart from head_dim.
    "gemma2-d256": dict(
        architecture="gemma2",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=192,
        attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0,
        sliding_window=64,
    ),
    # Gemma 3 1B's heads (4 of 256 dims, one KV head): q/k norms, a local rotary for the sliding
    # layers, linear scaling on the global ones.
    "gemma3-d256": dict(
        architecture="gemma3",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=64,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    ),
    # Phi-3-mini-4k's kind: head_dim 96 (hidden / heads), MHA, fused qkv_proj / gate_up_proj, a
    # window in every layer.
    "phi3-d96": dict(
        architecture="phi3",
        hidden_size=768,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        sliding_window=64,
    ),
    # Phi-4-mini's kind: rotary over 96 of 128 dims (the rotary kernel's partial path), GQA.
    "phi3-partial-d128": dict(
        architecture="phi3",
        hidden_size=1024,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        partial_rotary_factor=0.75,
    ),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_dir(request, tmp_path_factory) -> str:
    settings = dict(SHAPES[request.param])
    directory = tmp_path_factory.mktemp(request.param)
    save_tiny_model(
        directory,
        settings.pop("architecture"),
        vocab_size=256,
        max_position_embeddings=4096,
        initializer_range=0.2,
        **settings,
    )
    return str(directory)


def test_fp32_greedy_is_token_identical_to_hf(model_dir, prompt_ids):
    import torch

    ours = engine_tokens(model_dir, prompt_ids, dtype="float32")
    theirs = hf_tokens(model_dir, prompt_ids, torch.float32)
    record(f"fp32_share_identical[{os.path.basename(model_dir)}]", share_identical(ours, theirs))
    assert ours == theirs


def test_bf16_greedy_agrees_with_hf(model_dir, prompt_ids):
    import torch

    ours = engine_tokens(model_dir, prompt_ids, dtype="bfloat16")
    theirs = hf_tokens(model_dir, prompt_ids, torch.bfloat16)
    record(f"bf16_share_identical[{os.path.basename(model_dir)}]", share_identical(ours, theirs))
    first_agree = sum(a[0] == b[0] for a, b in zip(ours, theirs))
    record(f"bf16_first_token_agreement[{os.path.basename(model_dir)}]", f"{first_agree}/{len(ours)}")
    assert first_agree >= 0.75 * len(ours)


def test_cuda_graphs_equal_eager(model_dir, prompt_ids):
    """The decode graphs replay eager decode bit for bit; steps with prefill stay off the graphs
    (mixed_graph_max_tokens=0, the pieces off), whose kernels round otherwise than the eager
    prefill's (tests/gpu/test_engine_gpu.py, the rows' bf16 bound)."""
    graphs = engine_tokens(
        model_dir, prompt_ids, dtype="bfloat16", mixed_graph_max_tokens=0, piecewise_cuda_graphs=False
    )
    eager = engine_tokens(model_dir, prompt_ids, dtype="bfloat16", enforce_eager=True)
    assert graphs == eager


def test_chunked_prefill_and_piecewise_graphs_equal_hf_in_fp32(model_dir, prompt_ids):
    """48-token chunks across the window, and the piecewise graphs' padded pieces (Gemma 3's two
    rotaries and scaled embeddings in the captured pieces): HF's tokens still."""
    import torch

    theirs = hf_tokens(model_dir, prompt_ids, torch.float32)
    assert engine_tokens(model_dir, prompt_ids, dtype="float32", max_num_batched_tokens=48) == theirs
    assert engine_tokens(model_dir, prompt_ids, dtype="float32", piecewise_cuda_graphs=True) == theirs


def test_a_small_cache_reuses_the_blocks_behind_the_window(model_dir, prompt_ids):
    """fp32, 32-token steps, a KV cache of 80 blocks of every layer: Gemma's sliding layers get a
    few blocks of their own (zllm/kv_layout.py), freed behind the window and reused (with
    preemptions) under the decode graphs' and the pieces' second block table; HF's tokens still."""
    import torch

    theirs = hf_tokens(model_dir, prompt_ids, torch.float32)
    assert engine_tokens(model_dir, prompt_ids, dtype="float32", max_num_batched_tokens=32, num_kv_blocks=80) == theirs
