"""The packed prefill attention (ops.packed_prefill_attention: every prefill request of a step in
one FlashAttention call) against the torch reference (zllm.workers.attention.paged_attention) run
in float64 on the same rounded inputs, inside mixed steps the way the model runner builds them:
decodes first, then prefills with and without a cached prefix, in a paged cache whose unused
slots hold NaN (reading one fails the comparison)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

from zllm.workers.attention import AttentionMetadata, pack_prefill, packed_prefill_of, paged_attention  # noqa: E402
from zllm.workers.ops import CudaOps, flash_varlen_available  # noqa: E402

DEVICE = "cuda"


def build_step(requests, *, num_heads, kv_heads, head_dim, block_size, dtype, seed=0, qkv_view=False):
    """requests: (cached prefix, new tokens) per request; decodes (new tokens == 1) must come first.
    Returns (query, cache with NaN holes, clean cache, metadata with the packed prefill)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    seq_lens = [prefix + new for prefix, new in requests]
    query_start_loc = np.concatenate(([0], np.cumsum([new for _, new in requests]))).tolist()
    num_decodes = sum(1 for _, new in requests if new == 1)
    blocks = [-(-n // block_size) for n in seq_lens]
    total = sum(blocks) + 4
    pool = torch.randperm(total, generator=gen, device=DEVICE).tolist()
    table = np.full((len(requests), max(blocks) + 1), pool[0], dtype=np.int64)  # pool[0]: a spare block
    valid = torch.zeros(total * block_size, dtype=torch.bool, device=DEVICE)
    for row, n in enumerate(seq_lens):
        ids = [pool.pop() for _ in range(blocks[row])]
        table[row, : len(ids)] = ids
        positions = np.arange(n)
        valid[
            torch.from_numpy(table[row, positions // block_size] * block_size + positions % block_size).to(DEVICE)
        ] = True
    cache = torch.randn(2, total, block_size, kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    valid = valid.view(1, total, block_size, 1, 1)
    clean, holes = cache * valid, cache.masked_fill(~valid, float("nan"))
    tokens = query_start_loc[-1]
    if qkv_view:  # the model's q: a strided view into the fused QKV projection's output
        qkv = torch.randn(tokens, (num_heads + 2 * kv_heads) * head_dim, generator=gen, device=DEVICE).to(dtype)
        query = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    else:
        query = torch.randn(tokens, num_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=DEVICE),
        block_tables=torch.from_numpy(table).to(DEVICE, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        seq_lens_list=seq_lens,
        query_start_loc=query_start_loc,
        num_decodes=num_decodes,
        block_size=block_size,
    )
    if num_decodes < len(requests):
        slots, cu = pack_prefill(table, seq_lens, query_start_loc, num_decodes, block_size)
        meta.prefill = packed_prefill_of(
            torch.from_numpy(slots).to(DEVICE), torch.from_numpy(cu).to(DEVICE), seq_lens, query_start_loc, num_decodes
        )
    return query, holes, clean, meta


def reference(query, clean, meta, scale):
    ref_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping,
        block_tables=meta.block_tables.long(),
        seq_lens=meta.seq_lens.long(),
        seq_lens_list=meta.seq_lens_list,
        query_start_loc=meta.query_start_loc,
        num_decodes=meta.num_decodes,
        block_size=meta.block_size,
    )
    return paged_attention(query.double(), clean.double(), ref_meta, scale)


STEPS = {
    "prefills_only": [(0, 17), (0, 256), (0, 33), (0, 2)],
    "chunks_with_prefix": [(40, 24), (0, 100), (511, 1), (300, 212), (15, 3)],
    "mixed_step": [(7, 1), (130, 1), (1000, 1), (0, 64), (96, 32), (0, 5), (1, 127)],
    "one_long": [(3000, 1), (0, 2048)],
}


@pytest.fixture(scope="module", autouse=True)
def needs_flash():
    if not flash_varlen_available(torch.device(DEVICE)):
        pytest.skip("PyTorch's FlashAttention is not available on this GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(
    "heads", [(32, 8, 128), (9, 3, 64), (16, 16, 64), (8, 1, 128)], ids=lambda h: "h{}_kv{}_d{}".format(*h)
)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
def test_packed_prefill_matches_reference(dtype, heads, block_size, step):
    num_heads, kv_heads, head_dim = heads
    requests = sorted(STEPS[step], key=lambda r: r[1] != 1)  # decodes first, as the runner orders them
    query, holes, clean, meta = build_step(
        requests,
        num_heads=num_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        qkv_view=True,
    )
    scale = head_dim**-0.5
    ops = CudaOps(torch.device(DEVICE))
    assert meta.prefill is not None and ops.packs_prefill(dtype, head_dim)
    out = ops.attention(query, holes, meta, scale)
    expected = reference(query, clean, meta, scale)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_packed_equals_the_per_request_loop():
    """The two GPU paths agree to bf16 rounding on a step with prefixes and decodes."""
    requests = sorted(STEPS["mixed_step"], key=lambda r: r[1] != 1)
    query, holes, clean, meta = build_step(
        requests, num_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, seed=3
    )
    ops = CudaOps(torch.device(DEVICE))
    packed = ops.attention(query, clean, meta, 128**-0.5)
    meta.prefill = None
    looped = ops.attention(query, clean, meta, 128**-0.5)
    torch.testing.assert_close(packed.float(), looped.float(), rtol=1e-2, atol=1e-2)
    assert not torch.equal(packed, torch.zeros_like(packed))


def test_fp32_keeps_the_per_request_path():
    """FlashAttention has no fp32 kernel: the runner packs nothing for an fp32 model (nor for a
    head size flash lacks), and the per-request path stays exact."""
    ops = CudaOps(torch.device(DEVICE))
    assert not ops.packs_prefill(torch.float32, 64) and not ops.packs_prefill(torch.bfloat16, 80)
    requests = [(0, 40), (12, 20)]
    query, holes, clean, meta = build_step(
        requests, num_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=5
    )
    meta.prefill = None
    out = ops.attention(query, holes, meta, 0.125)
    torch.testing.assert_close(out.double(), reference(query, clean, meta, 0.125), rtol=1e-5, atol=1e-5)
