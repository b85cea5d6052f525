"""Tensor parallelism on two GPUs (NCCL): tp 2 greedy vs HF in fp32, CUDA graphs (with the
all-reduce captured) vs eager in bf16."""

from __future__ import annotations

import os

import pytest

from tests.gpu.test_engine_gpu import _engine_tokens, _hf_tokens, _record, _share_identical, model_dir, prompt_ids

pytestmark = [pytest.mark.gpu]

__all__ = ["model_dir", "prompt_ids"]  # fixtures shared with test_engine_gpu


@pytest.fixture(autouse=True)
def _two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def test_tensor_parallel_fp32_greedy_is_token_identical_to_hf(model_dir, prompt_ids):
    import torch

    ours = _engine_tokens(model_dir, prompt_ids, dtype="float32", tensor_parallel_size=2)
    theirs = _hf_tokens(model_dir, prompt_ids, torch.float32)
    _record(f"tp2_fp32_share_identical[{os.path.basename(model_dir)}]", _share_identical(ours, theirs))
    assert ours == theirs


def test_tensor_parallel_cuda_graphs_equal_eager(model_dir, prompt_ids):
    graphs = _engine_tokens(model_dir, prompt_ids, dtype="bfloat16", tensor_parallel_size=2)
    eager = _engine_tokens(model_dir, prompt_ids, dtype="bfloat16", tensor_parallel_size=2, enforce_eager=True)
    _record(f"tp2_bf16_share_identical_vs_tp1[{os.path.basename(model_dir)}]",
            _share_identical(graphs, _engine_tokens(model_dir, prompt_ids, dtype="bfloat16")))
    assert graphs == eager
