"""Which decode attention build runs a call (zllm/workers/kernels/attention.py): the setting's
values, the pipelined build's coverage and fallback, and its shared memory (no GPU needed; the
kernels themselves: tests/gpu/test_decode_attention_pipe_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from zllm import envs
from zllm.workers.kernels import attention

COVERED = dict(
    query_dtype=torch.bfloat16,
    head_dim=128,
    block_size=16,
    partition_size=512,
    num_slots=28033 * 16,
    window=None,
    softcap=None,
)


def test_setting_defaults_to_classic_and_rejects_unknown_builds(monkeypatch):
    monkeypatch.delenv("ZLLM_DECODE_ATTENTION", raising=False)
    assert envs.ZLLM_DECODE_ATTENTION == "classic"
    monkeypatch.setenv("ZLLM_DECODE_ATTENTION", " Pipe3 ")
    assert envs.ZLLM_DECODE_ATTENTION == "pipe3"
    monkeypatch.setenv("ZLLM_DECODE_ATTENTION", "fast")
    with pytest.raises(ValueError, match="ZLLM_DECODE_ATTENTION='fast'"):
        envs.read("ZLLM_DECODE_ATTENTION")


@pytest.mark.parametrize("build, stages", [("classic", 0), ("pipe", 2), ("pipe3", 3)])
def test_covered_calls_take_the_build_asked_for(build, stages):
    assert attention.decode_build_stages(build, **COVERED) == stages
    fp16_d64 = {**COVERED, "query_dtype": torch.float16, "head_dim": 64}
    assert attention.decode_build_stages(build, **fp16_d64) == stages


@pytest.mark.parametrize(
    "change",
    [
        {"query_dtype": torch.float32},
        {"head_dim": 96},
        {"head_dim": 256},
        {"window": 4096},
        {"softcap": 50.0},
        {"block_size": 4},  # a 512-token partition spans 129 blocks: more than the 128 staged
        {"num_slots": 2**31},
    ],
)
def test_uncovered_calls_fall_back_to_classic(change):
    assert attention.decode_build_stages("pipe", **{**COVERED, **change}) == 0
    assert attention.decode_build_stages("pipe3", **{**COVERED, **change}) == 0


def test_partition_table_bound():
    # ceil(partition / block) + 1 entries (a partition may start inside a block) must fit in 128.
    assert attention.decode_build_stages("pipe", **{**COVERED, "block_size": 8, "partition_size": 1008}) == 2
    assert attention.decode_build_stages("pipe", **{**COVERED, "block_size": 8, "partition_size": 1024}) == 0


def test_shared_memory_per_block():
    # 4 warps x stages x 16 tokens x (key row + 16 bytes of padding + value row)
    assert attention.pipe_shared_bytes(128, 2, 2) == 4 * 2 * 16 * (256 + 16 + 256) == 67584
    assert attention.pipe_shared_bytes(128, 2, 3) == 101376
    assert attention.pipe_shared_bytes(128, 1, 2) == attention.pipe_shared_bytes(64, 2, 2) == 34816
    # An H100 SM has 228 KiB: 3 blocks at 2 stages, 2 at 3 (1 KiB reserved per block, ~4 KiB static).
    assert 3 * (67584 + 1024 + 4096) <= 228 * 1024 < 4 * (67584 + 1024)
    assert 2 * (101376 + 1024 + 4096) <= 228 * 1024 < 3 * (101376 + 1024)
