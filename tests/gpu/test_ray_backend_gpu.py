"""The Ray backend on two GPUs of one node (a local Ray cluster started by the engine): tp 2 as Ray
actors gives the same fp32 greedy tokens as tp 2 as worker processes (mp) and as HF; in bf16 with
the symmetric-memory all-reduce (which needs each rank to see its peer's GPU: the executor sets
CUDA_VISIBLE_DEVICES to the node's GPUs of the engine) it equals mp token for token. The models and
prompts are tests/gpu/conftest.py's model_dir and prompt_ids. benchmarks/gpu/run_ray.sh runs
this file and the W2 comparison."""

from __future__ import annotations

import os

import pytest

from tests.helpers.gpu import engine_tokens, hf_tokens, record, share_identical

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _two_gpus_and_ray():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    pytest.importorskip("ray", reason="pip install zllm[ray] (benchmarks/gpu/run_ray.sh carries the wheel)")


def test_ray_tp2_fp32_equals_mp_and_hf(model_dir, prompt_ids):
    import torch

    ray_tokens = engine_tokens(
        model_dir, prompt_ids, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    mp_tokens = engine_tokens(model_dir, prompt_ids, dtype="float32", tensor_parallel_size=2)
    theirs = hf_tokens(model_dir, prompt_ids, torch.float32)
    record(f"ray_tp2_fp32_share_identical_vs_mp[{os.path.basename(model_dir)}]", share_identical(ray_tokens, mp_tokens))
    assert ray_tokens == mp_tokens
    assert ray_tokens == theirs


def test_ray_tp2_bf16_symmetric_all_reduce_equals_mp(model_dir, prompt_ids):
    args = dict(dtype="bfloat16", tensor_parallel_size=2, custom_all_reduce_max_bytes=64 << 10)
    ray_tokens = engine_tokens(model_dir, prompt_ids, distributed_executor_backend="ray", **args)
    mp_tokens = engine_tokens(model_dir, prompt_ids, **args)
    record(
        f"ray_tp2_bf16_symmetric_share_identical_vs_mp[{os.path.basename(model_dir)}]",
        share_identical(ray_tokens, mp_tokens),
    )
    assert ray_tokens == mp_tokens
