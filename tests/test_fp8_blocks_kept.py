"""Block-FP8 weights kept in FP8 (ZLLM_FP8_BLOCKS keep, CUDA's default for DeepSeek-V3's
checkpoints): the torch arithmetic that the CUDA path runs, on the CPU, against the dequantize-at-
load reference (fp8.dequantize: fp8 x scale in fp32, then the model dtype). The whole models are
in tests/test_deepseek_models.py (greedy tokens against transformers) and tests/gpu/."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zllm.partition import Span
from zllm.quantization import keeps_fp8_blocks
from zllm.workers import fp8
from zllm.workers.fp8 import E4M3, dequantize, dequantize_stacked, quantize_blocks
from zllm.workers.models.moe import Fp8Experts, expert_loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 256, 384), (2, 200, 136), (1, 64, 32)])
def test_dequantize_stacked_equals_dequantize_then_the_model_dtype(monkeypatch, dtype, shape):
    """Whole and partial 128x128 tiles, a few matrices at a time (a chunk bound smaller than one
    matrix and than the stack), bit for bit."""
    torch.manual_seed(0)
    pairs = [quantize_blocks(torch.randn(shape[1:]) * 0.05) for _ in range(shape[0])]
    q, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    expected = torch.stack([dequantize(a, s, block=True).to(dtype) for a, s in pairs])
    for chunk in (1, shape[1] * shape[2] + 1, 1 << 26):
        monkeypatch.setattr(fp8, "_DEQUANT_CHUNK_ELEMENTS", chunk)
        out = dequantize_stacked(q, scale, torch.empty(shape, dtype=dtype))
        assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_scaled_linear_equals_dequantize_then_linear(dtype):
    """The weight-only 128x128 product (CUDA: this layer's weights dequantized into the model
    dtype right before F.linear) against the dequantize-at-load layer's F.linear."""
    torch.manual_seed(1)
    q, scale = quantize_blocks(torch.randn(300, 200) * 0.05)
    x = torch.randn(5, 200).to(dtype)
    bias = torch.randn(300).to(dtype)
    expected = F.linear(x, dequantize(q, scale, block=True).to(dtype), bias)
    dense = dequantize_stacked(q[None], scale[None], torch.empty((1, 300, 200), dtype=dtype))[0]
    assert torch.equal(F.linear(x, dense, bias), expected)
    # The CPU's path (fp8_linear's emulation, activation "none"): fp32 products of the fp32
    # weights, so in bf16 only close (the weights are not rounded to bf16 first).
    emulated = fp8.fp8_linear(x, q, scale, None, "none", True, bias)
    atol = (1e-5 if dtype == torch.float32 else 2e-2) * expected.abs().max().item()
    torch.testing.assert_close(emulated.float(), expected.float(), rtol=0, atol=atol)


def _experts(num_experts: int, hidden: int, inter: int) -> tuple[Fp8Experts, torch.Tensor, torch.Tensor]:
    """Fp8Experts filled through its loading targets (dummy weights' path: values quantized per
    tile while loading) and the dequantized stacks the dequantize-at-load model would hold."""
    torch.manual_seed(2)
    experts = Fp8Experts(num_experts, hidden, inter, Span(0, inter), serialized=False)
    gates, ups, downs = [], [], []
    for e in range(num_experts):
        gate, up, down = torch.randn(inter, hidden) * 0.1, torch.randn(inter, hidden) * 0.1, torch.randn(hidden, inter)
        experts.load_target("gate_up_proj", 2 * e).fill(gate)
        experts.load_target("gate_up_proj", 2 * e + 1).fill(up)
        experts.load_target("down_proj", e).fill(down * 0.1)
        gates.append(dequantize(*quantize_blocks(gate), block=True))
        ups.append(dequantize(*quantize_blocks(up), block=True))
        downs.append(dequantize(*quantize_blocks(down * 0.1), block=True))
    gate_up = torch.stack([torch.cat(pair) for pair in zip(gates, ups)])
    return experts, gate_up, torch.stack(downs)


@pytest.mark.parametrize("hidden, inter", [(160, 136), (256, 128)], ids=["edge-tiles", "whole-tiles"])
@pytest.mark.parametrize("tokens", [1, 3, 40])  # pairs fewer than the experts (gathered) and more
def test_fp8_experts_equal_the_dequantized_experts(tokens, hidden, inter):
    """The loop (CPU, fp32) and the stacks the fused kernels get (the chosen experts gathered and
    renumbered, or every expert) both compute what the dequantized experts compute."""
    experts, gate_up, down = _experts(num_experts=8, hidden=hidden, inter=inter)
    blocks = (-(-inter // 128), -(-hidden // 128))
    assert experts.gate_up_proj.dtype == E4M3 and experts.gate_up_proj_scale_inv.shape == (8, 2 * blocks[0], blocks[1])
    torch.manual_seed(3)
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    expected = expert_loop(x, weights, ids, gate_up, down)
    assert torch.equal(experts(x, weights, ids), expected)
    stacked_gate_up, stacked_down, stacked_ids = experts.stacked(ids, torch.float32)
    assert stacked_gate_up.shape[0] == min(2 * tokens, 8)
    torch.testing.assert_close(expert_loop(x, weights, stacked_ids, stacked_gate_up, stacked_down), expected)


def test_a_kept_checkpoint_holds_the_stored_fp8_weights(tmp_path, monkeypatch):
    """The worker's model with ZLLM_FP8_BLOCKS=keep: the checkpoint's FP8 weights and scales in
    the linear layers, the experts and the shared experts; kv_b_proj dequantized (the absorbed
    decode multiplies by it); with the default on the CPU, everything dequantized."""
    from tests.helpers.models import save_tiny_v3_fp8
    from zllm.config import EngineConfig
    from zllm.workers.model_runner import ModelRunner

    model_dir = save_tiny_v3_fp8(tmp_path / "v3fp8")
    config = EngineConfig(model=str(model_dir), dtype="float32")
    dtypes = {}
    for mode in ("keep", "auto"):
        monkeypatch.setenv("ZLLM_FP8_BLOCKS", mode)
        runner = ModelRunner(config, torch.device("cpu"))
        runner.load_model()
        dtypes[mode] = {name: p.dtype for name, p in runner.model.named_parameters()}
    kept = dtypes["keep"]
    for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.shared_experts.gate_up_proj.weight"):
        assert kept[f"model.layers.1.{name}"] == E4M3
    assert kept["model.layers.1.mlp.experts.gate_up_proj_scale_inv"] == torch.float32
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert kept[f"model.layers.0.self_attn.{name}.weight"] == E4M3
    assert kept["model.layers.0.self_attn.kv_b_proj.weight"] == torch.float32
    assert kept["model.layers.0.mlp.gate_up_proj.weight_scale_inv"] == torch.float32
    assert set(dtypes["auto"].values()) == {torch.float32}


def test_the_mode_setting():
    assert keeps_fp8_blocks("auto", cuda=True) and not keeps_fp8_blocks("auto", cuda=False)
    assert keeps_fp8_blocks("keep", cuda=False) and not keeps_fp8_blocks("dequantize", cuda=True)
    with pytest.raises(ValueError, match="ZLLM_FP8_BLOCKS: 'yes' is not one of auto, keep, dequantize"):
        keeps_fp8_blocks("yes", cuda=True)
