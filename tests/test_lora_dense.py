"""LoRA's dense path (zllm/workers/lora.py's `LoRALayer.add_dense`: one GEMM over every slot's A,
each row masked to its own slot, one GEMM a part over every slot's B) against the per-slot torch
reference (`apply_slot`) on the CPU: rows of mixed slots, of the base model and of padding; fp32
and bf16; 1 to 3 fused parts; adapters of ranks below max_lora_rank and of different scales per
part (folded into A, as LoRAManager stores them); a column-parallel and a row-parallel
projection. The same torch ops run on CUDA (tests/gpu/test_lora_gpu.py)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from zllm.partition import Span
from zllm.workers.distributed import TensorParallel
from zllm.workers.linear_weights import FusedPart
from zllm.workers.lora import LoRABatch, LoRALayer, dense_from
from zllm.workers.parallel_layers import ColumnParallelLinear, RowParallelLinear

IN, SLOTS, MAX_RANK = 48, 4, 16


def column_layer(parts: list[int], dtype: torch.dtype, batch: LoRABatch) -> LoRALayer:
    with torch.device("cpu"):
        linear = ColumnParallelLinear(IN, [FusedPart(rows, Span(0, rows)) for rows in parts], bias=False)
    linear.to(dtype)
    return LoRALayer(linear, SLOTS, MAX_RANK, batch)


def row_layer(out: int, dtype: torch.dtype, batch: LoRABatch) -> LoRALayer:
    linear = RowParallelLinear(IN, out, Span(0, IN), bias=False, tp=TensorParallel())
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
