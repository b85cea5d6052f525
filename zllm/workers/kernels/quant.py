"""FP8 E4M3 activation quantization (csrc/quant_kernels.cu): per token, one scale a row or one
per 128 columns. QUANT_VEC_ENABLED is read from zllm.envs once, at import."""

from __future__ import annotations

import numpy as np
import torch

from zllm import envs
from zllm.workers.kernels.checks import (
    MAX_GRID_YZ,
    aligned16,
    check_cuda,
    check_rows,
    dtype_suffix,
    fail,
    ptr,
    threads_for,
)
from zllm.workers.kernels.loader import launch

_QUANT_VECS = (1, 2, 4, 8)  # 16-byte pieces per thread of the quant_fp8_rows_vec<V> kernels
_MAX_THREADS = 1024
# ZLLM_QUANT_VEC=0 sends every row through the scalar two-pass kernel: the A/B switch of
# benchmarks/gpu/run_perf.sh's fp8 part.
QUANT_VEC_ENABLED = envs.ZLLM_QUANT_VEC


def quant_fp8_rows(
    q: torch.Tensor,
    scales: torch.Tensor | None,
    x: torch.Tensor,
    static_scale: torch.Tensor | None = None,
    *,
    vectorized: bool | None = None,
) -> torch.Tensor:
    """q [M, K] (E4M3) = x / s per token: s = amax(|row|) / 448 written to scales [M, 1] (fp32),
    or the one fp32 `static_scale` (scales unused). Returns q. Rows of whole, aligned 16-byte
    pieces go through the one-pass kernel; vectorized=False forces the scalar one (the A/B of
    benchmarks/fp8_linear.py; None: QUANT_VEC_ENABLED)."""
    op = "quant_fp8_rows"
    device = check_cuda(op, q=q, scales=scales, x=x, static_scale=static_scale)
    suffix = dtype_suffix(op, x, "x")
    rows, x_stride = check_rows(op, x, "x")
    _check_fp8_out(op, q, x)
    if static_scale is None:
        if scales is None or scales.dtype != torch.float32 or scales.numel() != rows or not scales.is_contiguous():
            fail(op, f"scales must be a contiguous fp32 tensor of {rows} elements")
    elif static_scale.dtype != torch.float32 or static_scale.numel() != 1:
        fail(op, "static_scale must be one fp32 value")
    if rows == 0 or x.shape[-1] == 0:
        return q
    k = x.shape[-1]
    args = (ptr(q), ptr(scales), ptr(x), np.int32(k), np.int64(x_stride), ptr(static_scale))
    per16 = 16 // x.element_size()
    units = k // per16
    vecs = next((v for v in _QUANT_VECS if -(-units // v) <= _MAX_THREADS), None)
    if vectorized is None:
        vectorized = QUANT_VEC_ENABLED
    if vectorized and vecs is not None and k % per16 == 0 and x_stride % per16 == 0 and aligned16(x, q):
        launch(
            "quant_kernels",
            f"quant_fp8_rows_vec{vecs}_{suffix}",
            device,
            (rows,),
            (threads_for(-(-units // vecs), _MAX_THREADS),),
            args,
        )
    else:
        launch("quant_kernels", f"quant_fp8_rows_{suffix}", device, (rows,), (threads_for(k // 8, 256),), args)
    return q


def quant_fp8_groups(q: torch.Tensor, scales_t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q [M, K] (E4M3) = x / s per token and 128 columns; the scales go to scales_t [G, M]
    (G = ceil(K / 128); its transpose is the [M, G] column-major layout of cuBLASLt's 1x128
    scaling). Returns q."""
    op = "quant_fp8_groups"
    device = check_cuda(op, q=q, scales_t=scales_t, x=x)
    suffix = dtype_suffix(op, x, "x")
    rows, x_stride = check_rows(op, x, "x")
    _check_fp8_out(op, q, x)
    groups = -(-x.shape[-1] // 128)
    if scales_t.dtype != torch.float32 or tuple(scales_t.shape) != (groups, rows) or not scales_t.is_contiguous():
        fail(op, f"scales_t must be a contiguous fp32 [{groups}, {rows}], got {tuple(scales_t.shape)} {scales_t.dtype}")
    if rows == 0 or groups == 0:
        return q
    if groups > 4 * MAX_GRID_YZ:
        fail(op, f"x has too many columns ({x.shape[-1]})")
    args = (ptr(q), ptr(scales_t), ptr(x), np.int32(rows), np.int32(x.shape[-1]), np.int64(x_stride))
    launch("quant_kernels", f"quant_fp8_groups_{suffix}", device, (rows, -(-groups // 4)), (128,), args)
    return q


def _check_fp8_out(op: str, q: torch.Tensor, x: torch.Tensor) -> None:
    if q.dtype != torch.float8_e4m3fn or tuple(q.shape) != tuple(x.shape) or not q.is_contiguous():
        fail(
            op,
            f"q must be a contiguous float8_e4m3fn tensor of x's shape {tuple(x.shape)}, got "
            f"{tuple(q.shape)} {q.dtype}",
        )
