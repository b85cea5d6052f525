"""The fused all-reduce + add-RMSNorm's CPU-visible parts (ZLLM_ALLREDUCE_NORM): the wrapper's
argument checks, the switch's default, and the fallback of a PendingSum the fused kernel does not
take (the norm then sums first, as without the switch). The kernel itself:
tests/gpu/test_allreduce_norm_gpu.py."""

from __future__ import annotations

import pytest
import torch

from zllm import envs
from zllm.workers.distributed import TensorParallel
from zllm.workers.kernels.allreduce import all_reduce_add_rms_norm, slots_needed
from zllm.workers.models.llama import RMSNorm
from zllm.workers.ops import TorchOps
from zllm.workers.parallel_layers import PendingSum


def test_switch_is_off_by_default(monkeypatch):
    monkeypatch.delenv("ZLLM_ALLREDUCE_NORM", raising=False)
    assert envs.ZLLM_ALLREDUCE_NORM is False
    monkeypatch.setenv("ZLLM_ALLREDUCE_NORM", "1")
    assert envs.ZLLM_ALLREDUCE_NORM is True


def test_wrapper_refuses_cpu_tensors():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    addresses = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="all_reduce_add_rms_norm: out is on cpu"):
        all_reduce_add_rms_norm(
            x, x.clone(), x[0].clone(), x.clone(), x.clone(), addresses, addresses, 0, 256, 512, 1e-6
        )
    assert slots_needed(8, 4) == 32


def test_pending_sum_the_kernel_does_not_take_is_summed_before_the_norm():
    """A one-rank group has no fused kernel: the norm resolves the PendingSum (all_reduce) and
    gives what add_rms_norm gives on the summed tensor."""
    gen = torch.Generator().manual_seed(0)
    partial, residual = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    norm = RMSNorm(64, 1e-6, TorchOps())
    norm.weight.data = 1 + 0.1 * torch.randn(64, generator=gen)
    tp = TensorParallel()
    assert not tp.fuses_add_rms_norm(partial, residual, norm.weight)
    got, got_residual = norm(PendingSum(partial, tp), residual.clone())
    want, want_residual = TorchOps().add_rms_norm(partial, residual.clone(), norm.weight, 1e-6)
    assert torch.equal(got, want) and torch.equal(got_residual, want_residual)
