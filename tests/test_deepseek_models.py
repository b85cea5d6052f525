"""DeepSeek-V2 / V3 (multi-head latent attention, DeepSeek's MoE) against HF transformers (fp32,
CPU), on tiny random checkpoints made by transformers itself.

Each case compares the engine's greedy tokens with HF generate's exactly: decode in the latent
space with the absorbed projections (HF expands every cached latent), prefill expanded, YaRN with
DeepSeek's mscale, first_k_dense_replace dense layers, shared experts and grouped routing (V2's
group_limited_greedy, V3's noaux_tc with e_score_correction_bias and routed_scaling_factor), at
tp 1 with chunked prefill and preemption from a small cache, and at tp 2 (two worker processes);
V3's FP8 release layout dequantized at load (tp 1, 2) and kept in FP8 (tp 4, 8: issue 38).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.engine import count_row_steps
from tests.helpers.models import greedy_engine_tokens, hf_greedy, save_tiny_model, save_tiny_v3_fp8
from tests.helpers.models import randomize_correction_bias as _randomize_correction_bias
from zllm import LLM

MAX_TOKENS = 12
PROMPTS = [[7, 3, 9, 11, 5], list(range(3, 40)), [7] * 5 + list(range(100, 130)), list(range(200, 213))]
# Positions past original_max_position_embeddings (32) reach YaRN's interpolated frequencies.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    rope_parameters={"rope_theta": 10000.0, **YARN},
    initializer_range=0.2,
)
CASES = {  # name: (architecture, config overrides)
    # V2-Lite's shape: no q_lora_rank (q_proj), softmax routing, no groups.
    "v2-lite": ("deepseek_v2", dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)),
    # V2: q_lora_rank, group_limited_greedy over 4 groups of 2, scaled weights.
    "v2": (
        "deepseek_v2",
        dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5),
    ),
    # V3: noaux_tc (sigmoid, correction bias, groups by their two best), renormalized and scaled.
    "v3": (
        "deepseek_v3",
        dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
}


def _save(tmp_path: Path, case: str) -> Path:
    architecture, overrides = CASES[case]
    model_dir = save_tiny_model(tmp_path / case, architecture, **{**COMMON, **overrides})
    if architecture == "deepseek_v3":
        _randomize_correction_bias(model_dir)
    return model_dir


def _hf_tokens(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    # HF's expert-by-expert loop, the reference (as tests/test_models.py).
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    return [hf_greedy(hf, p, MAX_TOKENS, eos_token_id=None) for p in prompts]


def _engine_tokens(model_dir: Path, prompts: list[list[int]], **engine_args):
    return greedy_engine_tokens(model_dir, prompts, MAX_TOKENS, **engine_args)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_hf_with_chunked_prefill_and_preemption(tmp_path, case):
    """16-token steps chunk every long prompt; 9 blocks of 8 tokens cannot hold all four
    sequences at once (20 blocks), so some are preempted and recomputed."""
    model_dir = _save(tmp_path, case)
    expected = _hf_tokens(model_dir, PROMPTS)
    tokens, llm = _engine_tokens(model_dir, PROMPTS, block_size=8, max_num_batched_tokens=16, num_kv_blocks=9)
    assert tokens == expected
    assert llm.engine.core.stats().num_preemptions > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_tokens_as_decode_rows_match_hf(tmp_path, monkeypatch, case):
    """mixed_graph_max_tokens: each 16-token step's prompt tokens go in as decode rows through the
    latent attention's decode path (the absorbed weights), each row reading the latents up to its
    own position."""
    model_dir = _save(tmp_path, case)
    rows = count_row_steps(monkeypatch)
    tokens, _ = _engine_tokens(model_dir, PROMPTS, block_size=8, max_num_batched_tokens=16, mixed_graph_max_tokens=16)
    assert tokens == _hf_tokens(model_dir, PROMPTS)
    assert any(rows)


@pytest.mark.parametrize("case", ["v2", "v3"])
def test_matches_hf_at_tp2(tmp_path, case):
    """Heads split over two ranks, the latent cache replicated on each."""
    model_dir = _save(tmp_path, case)
    tokens, _ = _engine_tokens(model_dir, PROMPTS, tensor_parallel_size=2, kv_cache_memory_bytes=4 << 20)
    assert tokens == _hf_tokens(model_dir, PROMPTS)


@pytest.mark.parametrize("tp", [1, 2])
def test_v3_fp8_block_checkpoint_matches_hf(tmp_path, tp):
    """DeepSeek-V3's FP8 release layout (write_fp8_block_weights: float8 weights, fp32
    weight_scale_inv per 128x128 block; a 256-row dense MLP and 128-row kv_b_proj span whole
    blocks): zllm dequantizes at load to the model dtype, transformers' finegrained_fp8 reader on
    the CPU does the same, and in fp32 the greedy tokens are equal."""
    from safetensors import safe_open

    from tests.helpers.models import write_fp8_block_weights
    from zllm.model_spec import ModelSpec

    architecture, overrides = CASES["v3"]
    config = {**COMMON, **overrides, "intermediate_size": 256, "qk_nope_head_dim": 16, "v_head_dim": 16}
    model_dir = save_tiny_model(tmp_path / "v3fp8", architecture, **config)
    _randomize_correction_bias(model_dir)
    write_fp8_block_weights(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.mlp.gate_proj.weight_scale_inv").shape == (2, 1)
    spec = ModelSpec.from_pretrained(str(model_dir))
    assert spec.dequantize_fp8_blocks and spec.quantization is None
    expected = _hf_tokens(model_dir, PROMPTS)
    tokens, _ = _engine_tokens(model_dir, PROMPTS, tensor_parallel_size=tp, kv_cache_memory_bytes=4 << 20)
    assert tokens == expected


def test_latent_cache_sizes_the_blocks(tmp_path):
    """The cache holds kv_lora_rank + qk_rope_head_dim values a token a layer, so a budget holds
    (2 x heads x head_dim) / latent_dim times the blocks of per-head K and V caches."""
    from zllm.kv_layout import cache_bytes_per_token
    from zllm.model_spec import ModelSpec

    model_dir = _save(tmp_path, "v2-lite")
    spec = ModelSpec.from_pretrained(str(model_dir))
    latent = COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
    assert cache_bytes_per_token(spec, 4, 4) == COMMON["num_hidden_layers"] * latent * 4
    budget = 1 << 20
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=budget, block_size=16)
    try:
        assert llm.engine.core.num_kv_blocks == budget // (16 * COMMON["num_hidden_layers"] * latent * 4)
        assert llm.engine.core.executor.runner.kv_caches[0].shape == (1, llm.engine.core.num_kv_blocks, 16, 1, latent)
    finally:
        llm.shutdown()


def test_latent_attention_keeps_the_pieces_off(tmp_path):
    """piecewise_cuda_graphs asked for: MLA's layers still run unpieced, since its cache write
    drops padded rows by a value read on the host (docs/architecture.md, piecewise graphs)."""
    llm = LLM(str(_save(tmp_path, "v2-lite")), dtype="float32", piecewise_cuda_graphs=True)
    try:
        assert llm.engine.core.executor.runner.pieces is None
    finally:
        llm.shutdown()


def test_what_is_not_supported_is_refused_before_any_worker(tmp_path):
    """A V2 config asking for V3's routing (HF's V2 router has none), and an FP8 KV cache for the
    latent cache: refused by the frontend, naming what."""
    from transformers import AutoConfig

    from zllm.model_spec import ModelSpec

    model_dir = _save(tmp_path, "v2")
    config = AutoConfig.from_pretrained(model_dir)
    config.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="^model: topk_method 'noaux_tc' is not supported"):
        ModelSpec.from_hf_config(config)
    with pytest.raises(ValueError, match="kv_cache_dtype.*latent \\(MLA\\) cache"):
        LLM(str(model_dir), dtype="float32", kv_cache_dtype="fp8")


@pytest.mark.parametrize("tp", [4, 8])
def test_v3_fp8_kept_in_fp8_matches_hf_at_tp4_and_tp8(tmp_path, monkeypatch, tp):
    """V3 split over 4 and 8 worker processes (MLA with the latent replicated, every expert sliced
    4 or 8 ways), its weights kept in FP8 as CUDA keeps them (ZLLM_FP8_BLOCKS=keep: each product
    on the dequantized values): both equal transformers' fp32 greedy tokens (transformers
    dequantizes the checkpoint at load), hence each other."""
    model_dir = save_tiny_v3_fp8(tmp_path / "v3fp8")
    prompts = PROMPTS[:2]
    expected = _hf_tokens(model_dir, prompts)
    monkeypatch.setenv("ZLLM_FP8_BLOCKS", "keep")  # the workers inherit it
    tokens, _ = _engine_tokens(model_dir, prompts, tensor_parallel_size=tp, kv_cache_memory_bytes=4 << 20)
    assert tokens == expected
