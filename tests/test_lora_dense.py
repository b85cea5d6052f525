"""LoRA's dense path (zllm/workers/lora.py's `LoRALayer.add_dense`: one GEMM over every slot's A,
each row masked to its own slot, one GEMM a part over every slot's B) against the per-slot torch
reference (`apply_slot`) on the CPU: rows of mixed slots, of the base model and of padding; fp32
and bf16; 1 to 3 fused parts; adapters of ranks below max_lora_rank and of different scales per
part (folded into A, as LoRAManager stores them); a column-parallel and a row-parallel
projection. The same torch ops run on CUDA (tests/gpu/test_lora_gpu.py).

Also the fused expand's wiring (`LoRALayer.project`: the shrink, then ops.linear_lora adding the
expand to the projection's own product in one GEMV launch on CUDA): on the CPU it runs
ops.linear_lora_reference, the kernels' math in torch, checked here against the base product plus
`apply_slot` for 1 to 8 rows, through the parallel layers' forward."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from zllm.partition import Span
from zllm.workers import ops
from zllm.workers.distributed import TensorParallel
from zllm.workers.kernels.matvec import LoRAEpilogue
from zllm.workers.linear_weights import FusedPart
from zllm.workers.lora import LoRABatch, LoRALayer, dense_from
from zllm.workers.parallel_layers import ColumnParallelLinear, RowParallelLinear

IN, SLOTS, MAX_RANK = 48, 4, 16


def column_layer(parts: list[int], dtype: torch.dtype, batch: LoRABatch, bias: bool = False) -> LoRALayer:
    with torch.device("cpu"):
        linear = ColumnParallelLinear(IN, [FusedPart(rows, Span(0, rows)) for rows in parts], bias=bias)
    linear.to(dtype)
    return LoRALayer(linear, SLOTS, MAX_RANK, batch)


def row_layer(out: int, dtype: torch.dtype, batch: LoRABatch, bias: bool = False) -> LoRALayer:
    linear = RowParallelLinear(IN, out, Span(0, IN), bias=bias, tp=TensorParallel())
    linear.to(dtype)
    return LoRALayer(linear, SLOTS, MAX_RANK, batch)


def fill_slots(layer: LoRALayer, gen: torch.Generator) -> None:
    """Slots 0-2 hold adapters (ranks 16, 8 and 4; a part of slot 1 left out), slot 3 stays empty."""
    dtype = layer.A.dtype
    for slot, rank in [(0, 16), (1, 8), (2, 4)]:
        for part, (_, rows) in enumerate(layer.part_rows):
            if slot == 1 and part == 1:
                continue  # an adapter that does not target this fused part
            a = torch.randn(rank, IN, generator=gen).to(dtype)
            b = torch.randn(rows, rank, generator=gen).to(dtype)
            scale = 0.5 + slot + 0.25 * part
            layer.store(slot, part, (a.float() * scale).to(dtype), b)


def reference(layer: LoRALayer, out: torch.Tensor, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    expected = out.clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            expected[row] += layer.apply_slot(slot, x[row : row + 1])[0]
    return expected


def batch_of(slots: list[int], padding: int, dtype: torch.dtype = torch.float32) -> LoRABatch:
    """The kernels' buffers as LoRAManager fills them: every row's slot, padding rows -1."""
    batch = LoRABatch(
        token_slots=torch.tensor(slots + [-1] * padding, dtype=torch.int32),
        slot_mask=torch.full((len(slots) + padding, SLOTS), float("nan"), dtype=dtype),
    )
    batch.fill_slot_mask()
    return batch


# fp32: the same sums in another order; bf16: the reference rounds t and each product to bf16.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=0.25, rtol=0.02)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("parts", [[24], [32, 16, 16], [40, 40]], ids=["one", "qkv", "gate_up"])
def test_dense_matches_each_slot_alone(dtype, parts):
    gen = torch.Generator().manual_seed(len(parts))
    slots = [0, 2, -1, 1, 0, 3, 2, -1, 1, 1]  # mixed, base rows, an empty slot (3)
    padding = 3
    batch = batch_of(slots, padding, dtype)
    layer = column_layer(parts, dtype, batch)
    fill_slots(layer, gen)
    rows = len(slots) + padding
    x = torch.randn(rows, IN, generator=gen).to(dtype)
    out = torch.randn(rows, sum(parts), generator=gen).to(dtype)
    expected = reference(layer, out, x, slots + [-1] * padding)
    got = layer.add_dense(out.clone(), x)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    base_rows = [r for r, s in enumerate(slots + [-1] * padding) if s < 0 or s == 3]
    assert torch.equal(got[base_rows], out[base_rows])  # untouched, not merely close


def test_dense_row_parallel_and_cleared_slot():
    """o/down: one part, B over the whole output; a cleared slot adds nothing."""
    gen = torch.Generator().manual_seed(7)
    slots = [1, 0, 2, 0, -1]
    batch = batch_of(slots, padding=0)
    layer = row_layer(24, torch.float32, batch)
    fill_slots(layer, gen)
    layer.clear(2)
    x = torch.randn(len(slots), IN, generator=gen)
    out = torch.randn(len(slots), 24, generator=gen)
    expected = reference(layer, out, x, slots)
    got = layer.add_dense(out.clone(), x)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    assert torch.equal(got[2], out[2]) and torch.equal(got[4], out[4])


def test_add_to_picks_the_path_by_launch_rows(monkeypatch):
    """Launches of dense_from rows or more take the dense path, fewer the kernels."""
    batch = batch_of([0, 1, 0, -1], padding=0)
    layer = column_layer([24], torch.float32, batch)
    taken = []
    monkeypatch.setattr(layer, "add_dense", lambda out, x: taken.append("dense") or out)
    monkeypatch.setattr(layer, "_add_with_kernels", lambda out, x: taken.append("kernels") or out)
    x, out = torch.zeros(4, IN), torch.zeros(4, 24)
    for dense_rows in (4, 5, 0):
        batch.dense_from = dense_rows
        layer.add_to(out, x)
    assert taken == ["dense", "kernels", "dense"]


def test_dense_from_reads_rows_per_slot(monkeypatch):
    for value, slots, expected in [("4", 8, 32), ("4", 16, 64), ("0.5", 3, 2), ("0", 8, 0), ("inf", 8, sys.maxsize)]:
        monkeypatch.setenv("ZLLM_LORA_DENSE_ROWS_PER_SLOT", value)
        assert dense_from(slots) == expected
    monkeypatch.delenv("ZLLM_LORA_DENSE_ROWS_PER_SLOT")
    assert dense_from(16) == math.ceil(4 * 16)


# ---- the fused expand (LoRALayer.project) ----------------------------------------------------------


def fused_batch(slots: list[int], dtype: torch.dtype) -> LoRABatch:
    """The kernel path's buffers with the fused expand on (dense path never)."""
    batch = batch_of(slots, padding=0, dtype=dtype)
    batch.fused_expand, batch.dense_from = True, sys.maxsize
    return batch


def fill_weights(layer: LoRALayer, gen: torch.Generator) -> None:
    """Random base weights (and bias) for the projection, then the adapters."""
    linear = layer.linear
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen))
        if linear.bias is not None:
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen))
    linear.lora = layer
    fill_slots(layer, gen)


# One row of an adapter, one of the base model, and mixed batches up to the GEMV kernels' 8 rows.
FUSED_SLOTS = {"1-adapter": [2], "1-base": [-1], "3-mixed": [0, 3, -1], "8-mixed": [1, 0, 2, -1, 0, 1, 2, 3]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("parts", [[24], [32, 16, 16], [40, 40]], ids=["one", "qkv", "gate_up"])
@pytest.mark.parametrize("slots", list(FUSED_SLOTS.values()), ids=list(FUSED_SLOTS))
def test_fused_expand_matches_each_slot_alone(dtype, parts, slots):
    gen = torch.Generator().manual_seed(len(parts) + len(slots))
    layer = column_layer(parts, dtype, fused_batch(slots, dtype), bias=True)
    fill_weights(layer, gen)
    x = torch.randn(len(slots), IN, generator=gen).to(dtype)
    assert layer.fuses(x)
    base = F.linear(x, layer.linear.weight, layer.linear.bias)
    got = layer.linear(x)  # ColumnParallelLinear.forward -> LoRALayer.project
    torch.testing.assert_close(got, reference(layer, base, x, slots), **TOLERANCE[dtype])


def test_fused_expand_row_parallel_with_bias():
    """o/down at tp 1: the bias and the expand in the one product; a cleared slot adds nothing."""
    gen = torch.Generator().manual_seed(11)
    slots = [1, -1, 2, 0]
    layer = row_layer(24, torch.float32, fused_batch(slots, torch.float32), bias=True)
    fill_weights(layer, gen)
    layer.clear(2)
    x = torch.randn(len(slots), IN, generator=gen)
    base = F.linear(x, layer.linear.weight, layer.linear.bias)
    got = layer.linear(x)
    torch.testing.assert_close(got, reference(layer, base, x, slots), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[1:3], base[1:3], atol=1e-5, rtol=1e-6)  # base row, cleared slot


def test_project_fuses_only_where_the_gemv_would_run(monkeypatch):
    """The switch off, a launch of the dense path, more rows than the GEMV kernels take: the
    weights' product, then add_to."""
    slots = [0, 1, -1, 0, 1, 2, 0, 1, 2]
    layer = column_layer([24], torch.float32, fused_batch(slots, torch.float32))
    fill_weights(layer, torch.Generator().manual_seed(3))
    taken = []
    monkeypatch.setattr(layer, "add_to", lambda out, x: taken.append(x.shape[0]) or out)
    x = torch.randn(len(slots), IN)
    layer.project(x[:8], None)  # fused
    layer.project(x, None)  # 9 rows
    layer.batch.dense_from = 2
    layer.project(x[:2], None)  # the dense path's
    layer.batch.dense_from, layer.batch.fused_expand = sys.maxsize, False
    layer.project(x[:1], None)  # switched off
    assert taken == [9, 2, 1]


def test_linear_lora_reference_reads_only_the_rows_slots():
    """Rows of slot -1 get the plain product whatever t holds; the others B[n, slot] . t[part]."""
    gen = torch.Generator().manual_seed(5)
    ends, rank, slots = [8, 12], 4, torch.tensor([-1, 1, 0], dtype=torch.int32)
    x, weight = torch.randn(3, IN, generator=gen), torch.randn(12, IN, generator=gen)
    t, b = torch.randn(3, 2 * rank, generator=gen), torch.randn(12, 2, rank, generator=gen)
    got = ops.linear_lora_reference(x, weight, None, LoRAEpilogue(t, b, slots, ends))
    expected = F.linear(x, weight)
    for row in (1, 2):
        slot = int(slots[row])
        expected[row, :8] += b[:8, slot] @ t[row, :rank]
        expected[row, 8:] += b[8:, slot] @ t[row, rank:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
