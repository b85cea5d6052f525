"""The CPU paged-attention decode kernel (csrc/cpu/paged_attention.c) against the torch reference
(zllm.workers.attention.decode_attention) over random shapes, context lengths, GQA ratios and
shuffled block tables; its build cache and its fallback when no compiler works."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zllm.workers import attention as ref
from zllm.workers.attention import AttentionMetadata
from zllm.workers.kernels import cpu as cpu_kernels
from zllm.workers.ops import TorchOps

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not cpu_kernels.is_available(), reason="no working C compiler")


def decode_case(
    generator: torch.Generator,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A query view (strided, as the fused QKV split leaves it), a cache full of garbage, and block
    tables drawn from a shuffled pool, padded with zeros as the model runner pads them."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # Garbage in every slot outside the contexts: reading one would show in the result.
    kv_cache = 1000 * torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(blocks_per_seq)
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.long)
    for row, count in enumerate(blocks_per_seq):
        block_tables[row, :count] = torch.tensor([pool.pop() for _ in range(count)])
        positions = torch.arange(seq_lens[row])
        slots = block_tables[row, positions // block_size] * block_size + positions % block_size
        flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
        flat[:, slots] = torch.randn(2, len(slots), num_kv_heads, head_dim, generator=generator)
    kv_cache = kv_cache.to(dtype)
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype)
    query = qkv[:, : num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.long),
        seq_lens_list=seq_lens,
        query_start_loc=list(range(len(seq_lens) + 1)),
        num_decodes=len(seq_lens),
        block_size=block_size,
    )
    return query, kv_cache, meta


def run_kernel(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, **layer
) -> torch.Tensor:
    out = torch.full_like(query, float("nan"))
    assert cpu_kernels.paged_attention_decode(out, query, kv_cache, meta.block_tables, meta.seq_lens, scale, **layer)
    return out


SHAPES = [
    # (heads, kv heads, head_dim, block size)
    (9, 3, 64, 16),  # SmolLM2-135M
    (8, 8, 64, 16),  # MHA
    (32, 8, 128, 16),  # Llama-3-8B
    (14, 2, 64, 32),  # GQA 7
    (4, 1, 80, 8),  # a head_dim without a specialised loop, one kv head
    (6, 2, 24, 1),  # block size 1, head_dim below one vector
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}-bs{}".format(*s))
def test_decode_kernel_matches_reference(shape):
    num_heads, num_kv_heads, head_dim, block_size = shape
    generator = torch.Generator().manual_seed(sum(shape))
    scale = 1.0 / math.sqrt(head_dim)
    for trial in range(4):
        num_seqs = int(torch.randint(1, 24, (1,), generator=generator))
        longest = (1, 40, 300, 1100)[trial]
        seq_lens = torch.randint(1, longest + 1, (num_seqs,), generator=generator).tolist()
        query, kv_cache, meta = decode_case(generator, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
        expected = ref.decode_attention(query, kv_cache, meta, scale)
        torch.testing.assert_close(run_kernel(query, kv_cache, meta, scale), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 16, 33, 5000])
@pytest.mark.parametrize("softcap", [None, 2.5], ids=["no-cap", "cap"])
def test_decode_kernel_window_and_softcap_match_reference(window, softcap):
    """A sliding window (the last `window` tokens, starting inside a block, on a block boundary,
    or longer than every context) and soft-capped scores (large, so the cap bends them)."""
    generator = torch.Generator().manual_seed(window)
    seq_lens = [1, 7, 16, 17, 40, 129, 600]
    query, kv_cache, meta = decode_case(generator, seq_lens, 9, 3, 64, 16)
    query = query * 4
    layer = dict(window=window, softcap=softcap)
    expected = ref.decode_attention(query, kv_cache, meta, 0.125, **layer)
    torch.testing.assert_close(run_kernel(query, kv_cache, meta, 0.125, **layer), expected, atol=1e-5, rtol=1e-5)
    if window < 600:  # the window changes the result where a context is longer
        assert not torch.allclose(expected[-1], ref.decode_attention(query, kv_cache, meta, 0.125)[-1], atol=1e-3)


def test_decode_kernel_handles_large_scores_and_one_token_contexts():
    # Scores in the hundreds (the max-subtracted softmax must not overflow) and contexts of one token.
    generator = torch.Generator().manual_seed(7)
    query, kv_cache, meta = decode_case(generator, [1, 1, 17, 600], 9, 3, 64, 16)
    query = query * 30
    expected = ref.decode_attention(query, kv_cache, meta, 1.0)
    torch.testing.assert_close(run_kernel(query, kv_cache, meta, 1.0), expected, atol=1e-5, rtol=1e-5)


def test_decode_kernel_is_the_same_on_any_thread_count():
    # A (sequence, kv head) task runs on one thread: the result does not depend on how many there are.
    generator = torch.Generator().manual_seed(8)
    query, kv_cache, meta = decode_case(generator, [5, 700, 33, 129, 64], 9, 3, 64, 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel(query, kv_cache, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(run_kernel(query, kv_cache, meta, 0.125), one)


def test_decode_kernel_bf16_matches_reference():
    generator = torch.Generator().manual_seed(9)
    query, kv_cache, meta = decode_case(generator, [3, 90, 250], 9, 3, 64, 16, dtype=torch.bfloat16)
    expected = ref.decode_attention(query.float(), kv_cache.float(), meta, 0.125)
    out = run_kernel(query, kv_cache, meta, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=0, rtol=2**-8)  # one bf16 rounding


def test_torch_ops_attention_uses_kernel_for_decodes_and_reference_for_prefills():
    generator = torch.Generator().manual_seed(10)
    query, kv_cache, meta = decode_case(generator, [12, 40, 35, 30], 9, 3, 64, 16)
    query = torch.randn(3 + 7, 9, 64, generator=generator)  # 3 decodes, then a 7-token chunk
    meta.num_decodes, meta.query_start_loc = 3, [0, 1, 2, 3, 10]
    expected = ref.paged_attention(query, kv_cache, meta, 0.125)
    torch.testing.assert_close(TorchOps().attention(query, kv_cache, meta, 0.125), expected, atol=1e-5, rtol=1e-5)
    layer = dict(window=9, softcap=3.0)  # a layer's window and cap reach both paths
    expected = ref.paged_attention(query, kv_cache, meta, 0.125, **layer)
    out = TorchOps().attention(query, kv_cache, meta, 0.125, **layer)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_build_is_cached_per_key(tmp_path):
    first = cpu_kernels.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build(tmp_path) == first and first.stat().st_mtime_ns == mtime


def test_concurrent_builds_share_one_library(tmp_path):
    # Two processes building into an empty cache at once (as tensor-parallel ranks do) both load it.
    script = (
        "import sys, ctypes; from pathlib import Path; from zllm.workers.kernels import cpu as cpu_kernels; "
        "ctypes.CDLL(str(cpu_kernels.build(Path(sys.argv[1])))); print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    assert [p.communicate(timeout=300)[0].strip() for p in procs] == ["ok", "ok"]
    assert len(list(tmp_path.glob("*/libzllm_cpu.so"))) == 1
    assert not list(tmp_path.glob("*/*.tmp"))


def test_failed_build_falls_back_to_torch_with_one_warning(tmp_path):
    script = """
import logging, math, torch
logging.basicConfig(level=logging.WARNING)
from zllm.workers.kernels import cpu as cpu_kernels
from zllm.workers import attention as ref
from zllm.workers.attention import AttentionMetadata
from zllm.workers.ops import TorchOps
kv = torch.randn(2, 4, 16, 1, 8)
q = torch.randn(2, 2, 8)
meta = AttentionMetadata(torch.zeros(2, dtype=torch.long), torch.tensor([[0, 1], [2, 0]]), torch.tensor([20, 3]),
                         [20, 3], [0, 1, 2], 2, 16)
for _ in range(3):
    assert not cpu_kernels.paged_attention_decode(torch.empty_like(q), q, kv, meta.block_tables, meta.seq_lens, 0.3)
assert torch.equal(TorchOps().attention(q, kv, meta, 0.3), ref.paged_attention(q, kv, meta, 0.3))
print("fell back")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CC": "false", "ZLLM_CACHE": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "fell back"
    assert result.stderr.count("CPU kernels unavailable") == 1
