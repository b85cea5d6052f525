"""Which decode attention build runs a call (zllm/workers/kernels/attention.py): the setting's
values, the pipelined build's coverage and fallback, its shared memory, and the partition size
the default picks (no GPU needed; the kernels themselves: tests/gpu/test_decode_attention_pipe_gpu.py)."""

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


def test_setting_defaults_to_pipe_and_rejects_unknown_builds(monkeypatch):
    monkeypatch.delenv("ZLLM_DECODE_ATTENTION", raising=False)
    assert envs.ZLLM_DECODE_ATTENTION == "pipe"
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


H100_SMS = 132


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(attention, "_sm_count", lambda device: H100_SMS)
    monkeypatch.delenv("ZLLM_DECODE_WIDE_PARTITIONS", raising=False)


@pytest.mark.parametrize("capacity, parts", [(1024, 1), (1000, 1), (8192, 8)])
def test_large_batches_take_1024_token_partitions(h100, capacity, parts):
    """Llama-3-8B's heads at batch 256: 2048 blocks a partition, 15 waves of an H100's SMs."""
    assert attention.attention_partitions(256, 32, 8, capacity, block_size=16) == (1024, parts)
    assert attention.attention_partitions(256, 32, 8, capacity, block_size=32) == (1024, parts)


def test_the_wide_partition_starts_at_three_waves(h100):
    rows = -(-3 * H100_SMS // 8)  # 8 kv heads, one block each (group 4)
    assert attention.attention_partitions(rows, 32, 8, 1024, block_size=16) == (1024, 1)
    assert attention.attention_partitions(rows - 1, 32, 8, 1024, block_size=16) == (512, 2)
    assert attention.attention_partitions(8, 32, 8, 1024, block_size=16) == (256, 4)  # few rows: split finer


def test_contexts_within_512_tokens_keep_512(h100):
    assert attention.attention_partitions(256, 32, 8, 512, block_size=16) == (512, 1)


@pytest.mark.parametrize("block_size", [None, 8])
def test_wide_partitions_need_a_known_block_size_the_pipelined_build_stages(h100, block_size):
    """Unknown block sizes (a workspace reserved ahead) count the most partitions; 8-token blocks
    would overflow the pipelined build's block-table staging at 1024 tokens."""
    assert attention.attention_partitions(256, 32, 8, 1024, block_size=block_size) == (512, 2)
    assert attention.decode_build_stages("pipe", **{**COVERED, "block_size": 8, "partition_size": 1024}) == 0


def test_the_switch_turns_wide_partitions_off(h100, monkeypatch):
    monkeypatch.setenv("ZLLM_DECODE_WIDE_PARTITIONS", "0")
    assert attention.attention_partitions(256, 32, 8, 1024, block_size=16) == (512, 2)


def test_an_asked_partition_size_is_kept(h100):
    assert attention.attention_partitions(256, 32, 8, 1024, partition_size=256, block_size=16) == (256, 4)


@pytest.fixture
def loop_on(h100, monkeypatch):
    monkeypatch.setenv("ZLLM_DECODE_PARTITION_LOOP", "1")


def test_the_loop_is_on_by_default(h100, monkeypatch):
    monkeypatch.delenv("ZLLM_DECODE_PARTITION_LOOP", raising=False)
    assert attention._loops(88, 32, 8, None)


@pytest.mark.parametrize(
    "rows, loops",
    [
        (8, False),  # 64 blocks a partition: fewer than half the SMs, the full grid
        (9, True),  # 72 blocks: the smallest batch that loops (2 x 72 >= 132)
        (88, True),
        (1024, True),
        (1025, False),  # past _LOOP_MAX_BATCH: each block would scan 1025 lengths
    ],
)
def test_which_batches_loop(loop_on, rows, loops):
    assert attention._loops(rows, 32, 8, None) is loops


def test_without_the_switch_nothing_loops(loop_on, monkeypatch):
    monkeypatch.setenv("ZLLM_DECODE_PARTITION_LOOP", "0")
    assert not attention._loops(88, 32, 8, None)


def test_the_loop_grid_is_one_wave_of_blocks(h100):
    """3 resident blocks an SM of an H100's 132: 396 blocks, whatever the heads (they claim every
    head slot's partitions); never fewer than one."""
    assert attention.loop_grid_blocks(None, 3) == 396
    assert attention.loop_grid_blocks(None, 1) == 132
    assert attention.loop_grid_blocks(None, 0) == 1


def test_the_loop_claims_fit_an_int():
    """From 2**30 claims (1024 rows x 12288 partitions x 86 head slots) the full grid runs: the
    _loop kernels count claims, and the grid past the last, in an int."""
    assert attention.loop_claims_fit(1024, 256, 8)
    assert attention.loop_claims_fit(1024, 12288, 85)
    assert not attention.loop_claims_fit(1024, 12288, 86)
    assert not attention.loop_claims_fit(1024, 12288, 65535)


@pytest.mark.parametrize("loop", ["0", "1"])
def test_the_partition_size_does_not_depend_on_the_loop(h100, monkeypatch, loop):
    """Batches that loop take 512-token partitions or more at any capacity, the full grid's size."""
    monkeypatch.setenv("ZLLM_DECODE_PARTITION_LOOP", loop)
    assert attention.attention_partitions(1, 32, 8, 1024, block_size=16) == (64, 16)
    assert attention.attention_partitions(1, 32, 8, 8192, block_size=16) == (256, 32)
    assert attention.attention_partitions(1, 32, 8, 32768, block_size=16) == (512, 64)
    assert attention.attention_partitions(8, 32, 8, 8192, block_size=16) == (512, 16)
    for rows, size in ((9, 512), (49, 512), (50, 1024), (256, 1024)):
        for capacity in (1024, 8192, 131072):
            expected = (size, -(-capacity // size))
            assert attention.attention_partitions(rows, 32, 8, capacity, block_size=16) == expected


def test_tiny_grids_take_64_token_partitions(h100):
    """Halving stops at _MIN_PARTITION: batch 1 over 1024 tokens (Llama-3-8B's heads: 8 blocks a
    partition; a tp 4 rank of Llama-3-70B's: 2 kv heads, each group in two blocks of 4)."""
    assert attention._MIN_PARTITION == 64
    assert attention.attention_partitions(1, 32, 8, 1024, block_size=16) == (64, 16)
    assert attention.attention_partitions(1, 16, 2, 1024, block_size=16) == (64, 16)
    assert attention.attention_partitions(1, 16, 2, 8192, block_size=16) == (128, 64)  # 4 blocks a partition
    assert attention.attention_partitions(4, 32, 8, 1024, block_size=16) == (128, 8)  # 32 blocks: as before
    assert attention.attention_partitions(1, 32, 8, 8192, block_size=16) == (256, 32)


@pytest.mark.parametrize(
    "group, batch, kv_heads, chunk",
    [
        (1, 1, 8, 1),
        (2, 1, 2, 4),
        (4, 1, 2, 4),
        (8, 1, 2, 4),
        (5, 4, 2, 4),
        (8, 5, 2, 8),
        (8, 8, 1, 4),
        (8, 9, 1, 8),
        (8, 1, 8, 4),
        (8, 2, 8, 8),
        (8, 64, 8, 8),
        (12, 1, 2, 8),
        (16, 1, 2, 8),
        (48, 1, 1, 8),
    ],
)
def test_groups_of_five_to_eight_split_only_in_tiny_grids(group, batch, kv_heads, chunk):
    """Groups of 5-8 heads: two blocks of 4 for up to _SPLIT_GROUP_MAX_KV_ROWS sequences x kv heads,
    one block of 8 past it; larger groups keep chunks of 8 in any grid."""
    assert attention._group_chunk(group, batch, kv_heads) == chunk


@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (16, 2), (64, 8), (8, 8)])
@pytest.mark.parametrize("max_len", [100, 1024, 8192, 131072])
def test_the_partitions_bound_covers_every_longest_context(h100, heads, kv_heads, max_len):
    """default_partitions_bound: no row count and no longest context up to max_len takes more."""
    for rows in (1, 2, 3, 4, 8, 16, 33, 64, 256):
        bound = attention.default_partitions_bound(rows, heads, kv_heads, max_len)
        step = max(1, max_len // 512)
        for longest in range(1, max_len + 1, step):
            for block_size in (None, 16):
                _, parts = attention.attention_partitions(rows, heads, kv_heads, longest, block_size=block_size)
                assert parts <= bound, (rows, longest, block_size)


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("max_model_len", [1000, 1025, 1050, 4000, 8192])
def test_the_partitions_bound_covers_a_graphs_capacity(h100, block_size, max_model_len):
    """A CUDA graph's grid covers the block table's capacity (max_model_len in whole blocks), which
    model_runner passes: with 128-token blocks it can take one 64-token partition more than
    max_model_len would."""
    capacity = -(-max_model_len // block_size) * block_size
    for heads, kv_heads in ((32, 8), (16, 2), (64, 8)):
        for rows in range(1, 20):
            _, parts = attention.attention_partitions(rows, heads, kv_heads, capacity, block_size=block_size)
            assert parts <= attention.default_partitions_bound(rows, heads, kv_heads, capacity)
