"""DeepSeek-V2 / V3 (multi-head latent attention, DeepSeek's MoE) against HF transformers (fp32,
CPU), on tiny random checkpoints made by transformers itself.

Each case compares the engine's greedy tokens with HF generate's exactly: decode in the latent
space with the absorbed projections (HF expands every cached latent), prefill expanded, YaRN with
DeepSeek's mscale, first_k_dense_replace dense layers, shared experts and grouped routing (V2's
group_limited_greedy, V3's noaux_tc with e_score_correction_bias and routed_scaling_factor), at
tp 1 with chunked prefill and preemption from a small cache, and at tp 2 (two worker processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.models import greedy_engine_tokens, hf_greedy, save_tiny_model
from zllm import LLM, SamplingParams

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


def _randomize_correction_bias(model_dir: Path) -> None:
    """HF starts e_score_correction_bias at zero; a random one changes which experts are picked."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    names = [name for name in tensors if name.endswith("e_score_correction_bias")]
    assert names
    for name in names:
        tensors[name] = torch.rand(tensors[name].shape, generator=generator) * 0.5
    save_file(tensors, path, metadata={"format": "pt"})


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


@pytest.mark.parametrize("case", ["v2", "v3"])
def test_matches_hf_at_tp2(tmp_path, case):
    """Heads split over two ranks, the latent cache replicated on each."""
    model_dir = _save(tmp_path, case)
    tokens, _ = _engine_tokens(model_dir, PROMPTS, tensor_parallel_size=2, kv_cache_memory_bytes=4 << 20)
    assert tokens == _hf_tokens(model_dir, PROMPTS)


# Issue 38's eight ranks: 8 heads (one a rank at tp 8), 16 routed experts in 8 groups, an expert
# intermediate size of 36 (ranks of 5 and 4 rows at tp 8, 9 at tp 4).
TP8 = dict(num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, n_group=8, topk_group=4)
TP8.update(moe_intermediate_size=36, num_hidden_layers=2)


@pytest.mark.parametrize("tp", [4, 8])
def test_v3_matches_hf_at_tp4_and_tp8(tmp_path, tp):
    """V3 (noaux_tc routing with a correction bias, MLA with the latent replicated) split over 4
    and 8 worker processes: both equal transformers' fp32 greedy tokens, hence each other."""
    architecture, overrides = CASES["v3"]
    model_dir = save_tiny_model(tmp_path / "v3", architecture, **{**COMMON, **overrides, **TP8})
    _randomize_correction_bias(model_dir)
    prompts = PROMPTS[:2]
    tokens, _ = _engine_tokens(model_dir, prompts, tensor_parallel_size=tp, kv_cache_memory_bytes=4 << 20)
    assert tokens == _hf_tokens(model_dir, prompts)


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


# Block-aligned at tp 2 (kept FP8 weights split only on 128-row tiles): q_b_proj 2 heads x 128
# rows a rank, kv_b_proj 2 x (64 + 64), o_proj 2 x 64 columns, experts and dense MLP 128 rows.
KEPT_FP8 = dict(qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, intermediate_size=256)
KEPT_FP8.update(moe_intermediate_size=256, n_shared_experts=1, num_hidden_layers=2)


@pytest.mark.parametrize("tp", [1, 2])
def test_v3_fp8_blocks_kept_in_fp8_match_the_dequantized_model(tmp_path, monkeypatch, tp):
    """ZLLM_FP8_BLOCKS=keep (CUDA's default) on the CPU: the layers hold the checkpoint's FP8
    weights and scales (experts included; kv_b_proj dequantized for the absorbed decode), each
    dequantized right before its product, so fp32 greedy tokens equal transformers' reading of
    the checkpoint (which dequantizes at load, as zllm's CPU default does)."""
    from tests.helpers.models import write_fp8_block_weights
    from zllm.workers.fp8 import E4M3

    architecture, overrides = CASES["v3"]
    model_dir = save_tiny_model(tmp_path / "v3fp8", architecture, **{**COMMON, **overrides, **KEPT_FP8})
    _randomize_correction_bias(model_dir)
    write_fp8_block_weights(model_dir)
    expected = _hf_tokens(model_dir, PROMPTS)
    monkeypatch.setenv("ZLLM_FP8_BLOCKS", "keep")
    if tp == 2:
        tokens, _ = _engine_tokens(model_dir, PROMPTS, tensor_parallel_size=2, kv_cache_memory_bytes=4 << 20)
        assert tokens == expected
        return
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=4 << 20)
    try:  # the model in this process: the checkpoint's FP8 weights, kv_b_proj dequantized
        params = dict(llm.engine.core.executor.runner.model.named_parameters())
        assert params["model.layers.1.mlp.experts.gate_up_proj"].dtype == E4M3
        assert params["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == E4M3
        assert params["model.layers.0.self_attn.q_b_proj.weight"].dtype == E4M3
        assert params["model.layers.0.self_attn.kv_b_proj.weight"].dtype == torch.float32
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        llm.shutdown()
