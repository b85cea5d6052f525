"""zllm's CUDA kernels (csrc/) on torch tensors, loaded through CuPy.

Importing this package needs neither CuPy nor a GPU; calling a kernel needs both (see
`is_available`). The torch references in zllm.workers.layers / zllm.workers.attention stay the
CPU path and the oracle of tests/gpu/test_kernels.py.
"""

from __future__ import annotations

from zllm.workers.kernels.loader import KernelUnavailableError, cupy_available, preload
from zllm.workers.kernels.ops import (
    attention_partitions,
    attention_workspace_numel,
    fp8_gemv,
    fp8_gemv_supported,
    fused_add_rms_norm,
    gemv,
    gemv_supported,
    paged_attention_decode,
    quant_fp8_groups,
    quant_fp8_rows,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    rotary_embedding_and_cache,
    silu_and_mul,
)

__all__ = [
    "KernelUnavailableError",
    "attention_partitions",
    "attention_workspace_numel",
    "fp8_gemv",
    "fp8_gemv_supported",
    "fused_add_rms_norm",
    "gemv",
    "gemv_supported",
    "is_available",
    "paged_attention_decode",
    "preload",
    "quant_fp8_groups",
    "quant_fp8_rows",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
]


def is_available() -> bool:
    """True when the kernels can run here: a CUDA device and an importable CuPy."""
    import torch

    return torch.cuda.is_available() and cupy_available()
