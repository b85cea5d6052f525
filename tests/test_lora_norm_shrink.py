"""The wiring of ZLLM_LORA_NORM_SHRINK (zllm/workers/lora.py `LoRALayer.norm_shrinks` /
`add_rms_norm` / `act_shrinks` / `act_and_mul` / `shrunk`, the decoder layer's norms and MLP in
zllm/workers/models/llama.py): the add-RMSNorm before an adapted q/k/v or gate/up projection, and
the MLP's gated activation before an adapted down projection, compute that projection's shrink in
the same launch (csrc/layernorm_kernels.cu and csrc/activation_kernels.cu on CUDA; on the CPU
TorchOps' reference, which the tests here run), and the projection uses it instead of launching its
own. Checked on the CPU: the switch (off by default; LoRAManager turns it on for CUDA's kernel path
only), the conditions (decode rows, the kernel path, not the dense one), and a decoder layer's
outputs (SwiGLU and GeGLU) equal to the unfused path's, with the shrink computed once a
projection. tests/gpu/test_lora_norm_gpu.py and tests/gpu/test_lora_act_gpu.py run the kernels."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.lora import NORM_HIDDEN as HIDDEN
from tests.helpers.lora import NORM_RANK as RANK
from tests.helpers.lora import NORM_SLOTS as SLOTS
from tests.helpers.lora import ShrinkCounts, run_lora_layer, tiny_lora_layer
from zllm import envs
from zllm.workers import ops
from zllm.workers.distributed import TensorParallel
from zllm.workers.kernels.activation import act_shrink_supported
from zllm.workers.kernels.layernorm import norm_shrink_supported
from zllm.workers.lora import LoRAManager
from zllm.workers.models.llama import RMSNorm


def test_the_switch_is_on_by_default(monkeypatch):
    monkeypatch.delenv("ZLLM_LORA_NORM_SHRINK", raising=False)
    assert envs.ZLLM_LORA_NORM_SHRINK is True
    monkeypatch.setenv("ZLLM_LORA_NORM_SHRINK", "0")
    assert envs.ZLLM_LORA_NORM_SHRINK is False


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_decoder_layer_with_the_norm_shrink_equals_without(rows, act, monkeypatch):
    """q/k/v's and the MLP's outputs and the residual are the unfused path's; each of qkv and
    gate_up's shrink ran in its norm (2 a layer), down's in the activation (1), o's alone (1)."""
    results = {}
    for fused in (False, True):
        layer, _, gen = tiny_lora_layer(fused, rows, rows, hidden_act=act)
        x, residual, attended = (torch.randn(rows, HIDDEN, generator=gen) for _ in range(3))
        with monkeypatch.context() as patch:
            counts = ShrinkCounts(patch, ops.TorchOps)
            results[fused] = run_lora_layer(layer, x, residual, attended)
        assert (counts.alone, counts.in_norm, counts.in_act) == ((1, 2, 1) if fused else (4, 0, 0))
        held = (layer.self_attn.qkv_proj.lora, layer.mlp.gate_up_proj.lora, layer.mlp.down_proj.lora)
        assert all(lora.held is None for lora in held)
    for got, expected in zip(results[True], results[False]):
        assert torch.equal(got, expected)


def test_norm_shrinks_only_where_its_conditions_hold():
    """The switch, the kernel path's buffers, decode rows (1-8), not a dense-path launch."""
    layer, batch, gen = tiny_lora_layer(True, 9, 0)
    lora = layer.mlp.gate_up_proj.lora
    weight = layer.post_attention_layernorm.weight
    x = torch.randn(9, HIDDEN, generator=gen)
    assert all(lora.norm_shrinks(x[:n], x[:n], weight) for n in (1, 2, 8))
    assert not lora.norm_shrinks(x, x, weight)  # 9 rows
    assert not lora.norm_shrinks(x[0], x[0], weight)  # not a [rows, hidden] launch
    batch.dense_from = 4
    assert not lora.norm_shrinks(x[:4], x[:4], weight) and lora.norm_shrinks(x[:3], x[:3], weight)
    batch.dense_from, batch.norm_shrink = sys.maxsize, False
    assert not lora.norm_shrinks(x[:1], x[:1], weight)
    batch.norm_shrink, batch.token_slots = True, None  # the torch path
    assert not lora.norm_shrinks(x[:1], x[:1], weight)


def test_act_shrinks_only_where_its_conditions_hold():
    """The activation's fusion follows the norm's: the switch, the kernel path's buffers, decode
    rows (1-8), not a dense-path launch, and gate/up rows twice down's input width."""
    layer, batch, gen = tiny_lora_layer(True, 9, 0)
    lora = layer.mlp.down_proj.lora
    width = 2 * lora.A.shape[2]
    x = torch.randn(9, width, generator=gen)
    assert all(lora.act_shrinks(x[:n]) for n in (1, 2, 8))
    assert not lora.act_shrinks(x)  # 9 rows
    assert not lora.act_shrinks(x[0])  # not a [rows, 2I] launch
    assert not lora.act_shrinks(x[:2, : width - 2])  # not down's input width
    batch.dense_from = 4
    assert not lora.act_shrinks(x[:4]) and lora.act_shrinks(x[:3])
    batch.dense_from, batch.norm_shrink = sys.maxsize, False
    assert not lora.act_shrinks(x[:1])
    batch.norm_shrink, batch.token_slots = True, None  # the torch path
    assert not lora.act_shrinks(x[:1])


def test_the_activation_holds_its_shrink_for_down_proj():
    """act_and_mul returns the activation's bits (TorchOps.silu_and_mul) and holds the shrink of
    that very tensor for down_proj; a copy of it launches its own."""
    layer, _, gen = tiny_lora_layer(True, 3, 2)
    lora = layer.mlp.down_proj.lora
    x = torch.randn(3, 2 * lora.A.shape[2], generator=gen)
    out = lora.act_and_mul(ops.TorchOps(), x, False)
    assert torch.equal(out, ops.TorchOps().silu_and_mul(x))
    assert lora.held is not None and lora.held[0] is out
    expected = ops.lora_shrink(out, lora.A, lora.batch.token_slots)
    assert torch.equal(lora.shrunk(out), expected) and lora.held is None
    lora.act_and_mul(ops.TorchOps(), x, True)
    copy = lora.held[0].clone()
    assert torch.equal(lora.shrunk(copy), ops.lora_shrink(copy, lora.A, lora.batch.token_slots))
    assert lora.held is None


def test_a_held_shrink_serves_only_its_own_tensor():
    """The projection of another tensor than the norm's output launches its own shrink, and a held
    shrink is dropped once read (a stale one never serves a later step)."""
    layer, _, gen = tiny_lora_layer(True, 2, 1)
    norm, lora = layer.post_attention_layernorm, layer.mlp.gate_up_proj.lora
    x, residual = torch.randn(2, HIDDEN, generator=gen), torch.randn(2, HIDDEN, generator=gen)
    normed, _ = norm(x, residual, lora)
    assert lora.held is not None and lora.held[0] is normed
    copy = normed.clone()
    t = lora.shrunk(copy)
    assert lora.held is None
    torch.testing.assert_close(t, ops.lora_shrink(copy, lora.A, lora.batch.token_slots))
    expected = RMSNorm(HIDDEN, norm.eps, ops.TorchOps())
    with torch.no_grad():
        expected.weight.copy_(norm.weight)
    assert torch.equal(normed, expected(x, residual)[0])


def test_the_kernel_takes_only_vector_rows():
    """norm_shrink_supported (the CUDA condition, shapes only): fp32/fp16/bf16, a width of whole
    16-byte pieces, contiguous, a's width the row's, its rows a multiple of 4."""
    for dtype, width in ((torch.float32, 4), (torch.bfloat16, 8), (torch.float16, 8)):
        x = torch.zeros(3, 16 * width, dtype=dtype)
        w, a = torch.zeros(16 * width, dtype=dtype), torch.zeros(2, 12, 16 * width, dtype=dtype)
        assert norm_shrink_supported(x, x.clone(), w, a)
        assert not norm_shrink_supported(x[:, 1:], x[:, 1:].clone(), w[1:], a[..., 1:])  # odd width
        assert not norm_shrink_supported(x, x.clone(), w, a[:, :10])  # 10 columns
        assert not norm_shrink_supported(x, x.clone(), w, a.to(torch.float64))  # a of another dtype
        strided = torch.zeros(3, 32 * width, dtype=dtype)[:, : 16 * width]  # rows of a wider buffer
        assert not norm_shrink_supported(strided, x.clone(), w, a)
    x = torch.zeros(2, 64, dtype=torch.float64)
    assert not norm_shrink_supported(x, x, x[0], torch.zeros(1, 4, 64, dtype=torch.float64))


def test_the_act_kernel_takes_only_vector_rows():
    """act_shrink_supported (the CUDA condition, shapes only): fp32/fp16/bf16 gate/up rows of an
    I of whole 16-byte pieces, contiguous, a [S, cols, I] of x's dtype, cols a multiple of 4."""
    for dtype, width in ((torch.float32, 4), (torch.bfloat16, 8), (torch.float16, 8)):
        d = 16 * width
        x, a = torch.zeros(3, 2 * d, dtype=dtype), torch.zeros(2, 16, d, dtype=dtype)
        assert act_shrink_supported(x, a)
        assert not act_shrink_supported(x[:, 2:], a[..., 1:])  # odd I
        assert not act_shrink_supported(x, a[:, :10])  # 10 columns
        assert not act_shrink_supported(x, a[..., : d - width])  # a's width not I
        assert not act_shrink_supported(x, a.to(torch.float64))  # a of another dtype
        assert not act_shrink_supported(torch.zeros(3, 4 * d, dtype=dtype)[:, : 2 * d], a)  # strided rows
    x = torch.zeros(2, 128, dtype=torch.float64)
    assert not act_shrink_supported(x, torch.zeros(1, 4, 64, dtype=torch.float64))


def test_manager_turns_it_on_for_cuda_only(monkeypatch):
    """On the CPU (no kernel path) LoRAManager leaves the switch off whatever the setting."""
    monkeypatch.setenv("ZLLM_LORA_NORM_SHRINK", "1")
    layer, _, _ = tiny_lora_layer(False, 1, 2)
    model = SimpleNamespace(model=SimpleNamespace(layers=[layer]))
    config = SimpleNamespace(max_lora_rank=RANK, max_loras=SLOTS, max_cpu_loras=None)
    manager = LoRAManager(model, config, None, TensorParallel())
    assert manager.batch.token_slots is None and manager.batch.norm_shrink is False
