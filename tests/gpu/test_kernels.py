"""The CUDA kernels (zllm.workers.kernels) against their torch references (zllm.workers.layers,
zllm.workers.attention) on random inputs: fp32 to ~1e-5, fp16/bf16 to 2e-2 of a float64 oracle
run on the same (rounded) inputs. Outputs are filled with NaN before each run, so an element the
kernel forgets to write fails the comparison."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import (  # noqa: E402
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    PagedBatch,
    assert_close,
    nan_like,
    randn,
)
from zllm.workers import kernels  # noqa: E402
from zllm.workers.attention import AttentionMetadata, paged_attention, write_kv_cache  # noqa: E402
from zllm.workers.kernels import loader  # noqa: E402
from zllm.workers.layers import apply_rotary, rms_norm, rope_cos_sin_cache, rope_inv_freq, silu_and_mul  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def classic_decode_attention(monkeypatch):
    """The paged decode attention here is the classic kernel (csrc/attention.cuh); the default
    pipelined build has its own file, test_decode_attention_pipe_gpu.py."""
    monkeypatch.setenv("ZLLM_DECODE_ATTENTION", "classic")


# ---- reshape_and_cache --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "qkv_view", "odd_stride"])
@pytest.mark.parametrize("tokens", [1, 7, 333])
def test_reshape_and_cache(dtype, layout, tokens, gen):
    kv_heads, head_dim, block_size, num_blocks = 2, 64, 16, 40
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    row = kv_heads * head_dim
    if layout == "contiguous":
        key = randn(tokens, kv_heads, head_dim, gen=gen, dtype=dtype)
        value = randn(tokens, kv_heads, head_dim, gen=gen, dtype=dtype)
    else:  # views into one fused buffer, as the model's qkv split gives; "odd" breaks 16-byte vectors
        width = 4 * row + (3 if layout == "odd_stride" else 0)
        fused = randn(tokens, width, gen=gen, dtype=dtype)
        key = fused[:, 2 * row : 3 * row].view(tokens, kv_heads, head_dim)
        value = fused[:, 3 * row : 4 * row].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    padding = torch.rand(tokens, generator=gen, device=DEVICE) < 0.2
    if tokens > 1:
        padding[0] = True
    slots = torch.where(padding, torch.full_like(slots, -1), slots)

    expected = cache.clone()
    keep = slots >= 0
    write_kv_cache(expected, key[keep], value[keep], slots[keep])
    kernels.reshape_and_cache(cache, key, value, slots)
    assert torch.equal(cache, expected)  # a copy: exact, padding slots untouched


def test_reshape_and_cache_all_padding(gen):
    cache = randn(2, 4, 16, 2, 64, gen=gen, dtype=torch.bfloat16)
    before = cache.clone()
    key = randn(5, 2, 64, gen=gen, dtype=torch.bfloat16)
    kernels.reshape_and_cache(cache, key, key.clone(), torch.full((5,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


# ---- paged attention (decode) ---------------------------------------------------------------------


BOUNDARY_LENS = [1, 15, 16, 17, 31, 33, 100, 257]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_block_boundaries(dtype, head_dim, group, gen):
    kv_heads = 2
    batch = PagedBatch(
        BOUNDARY_LENS,
        num_heads=kv_heads * group,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        gen=gen,
    )
    assert_close(batch.run(), batch.reference(), dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_block_sizes(block_size, dtype, gen):
    batch = PagedBatch(
        [1, 7, 8, 9, 32, 33, 150], num_heads=8, kv_heads=2, head_dim=128, block_size=block_size, dtype=dtype, gen=gen
    )
    assert_close(batch.run(), batch.reference(), dtype)


@pytest.mark.parametrize("group", [2, 5, 12, 16])
def test_decode_group_chunks(group, gen):
    """Groups that are not 1, 4 or 8 run padded chunks (2 -> 4; 5 -> 4 + 4, the second padded, in
    this grid of 6 sequences x kv heads) or several chunks of 8 (12, 16)."""
    batch = PagedBatch(
        [3, 40, 130], num_heads=2 * group, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, gen=gen
    )
    assert_close(batch.run(), batch.reference(), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("partition_size", [32, 64, 96, 512])
def test_decode_forced_partitions(dtype, partition_size, gen):
    """Split-K with small partitions on short contexts: one-partition sequences (written directly)
    next to many-partition ones (reduced), lengths on and around partition edges."""
    lens = [1, 31, 32, 33, 64, 65, 96, 97, 200, 700]
    batch = PagedBatch(lens, num_heads=8, kv_heads=2, head_dim=128, block_size=16, dtype=dtype, gen=gen)
    assert_close(batch.run(partition_size=partition_size), batch.reference(), dtype)
    assert_close(batch.run(partition_size=partition_size, max_seq_len=max(lens)), batch.reference(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("context", [4096, 32768])
def test_decode_long_context(dtype, context, gen):
    batch = PagedBatch(
        [context, context // 3 + 5, 17], num_heads=8, kv_heads=2, head_dim=128, block_size=16, dtype=dtype, gen=gen
    )
    expected = batch.reference()
    size, parts = kernels.attention_partitions(3, 8, 2, context, torch.device(DEVICE))
    assert parts > 1, "the split-K path must run"
    assert_close(batch.run(max_seq_len=context), expected, dtype)
    assert_close(batch.run(), expected, dtype)  # grid sized by the block table's capacity


@pytest.mark.parametrize("parts", [2, 8, 9, 40])
def test_decode_reduce_paths(parts, gen):
    """The reduce kernel combines up to 8 partitions in one round trip and more in its general
    path: both, around the switch, with one-partition sequences in the same batch."""
    lens = [parts * 64, parts * 64 - 63, 64, 1]
    batch = PagedBatch(lens, num_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, gen=gen)
    size, grid_parts = kernels.attention_partitions(4, 32, 8, max(lens), partition_size=64)
    assert grid_parts == parts
    assert_close(batch.run(partition_size=64, max_seq_len=max(lens)), batch.reference(), torch.bfloat16)


def test_decode_repeated_launches_are_identical(gen):
    batch = PagedBatch(
        [700, 5, 1500, 129], num_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, gen=gen
    )
    first = batch.run(partition_size=128).clone()
    assert_close(first, batch.reference(), torch.bfloat16)
    for _ in range(3):
        assert torch.equal(batch.run(partition_size=128), first)


def test_decode_strided_query_and_out(gen):
    """q as a view of a fused qkv buffer and out as a view of a wider buffer (token strides)."""
    num_heads, kv_heads, head_dim = 8, 2, 128
    batch = PagedBatch(
        [5, 77, 600],
        num_heads=num_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        gen=gen,
    )
    width = (num_heads + 2 * kv_heads) * head_dim
    qkv = randn(3, width, gen=gen, dtype=torch.bfloat16)
    query = qkv[:, : num_heads * head_dim].view(3, num_heads, head_dim)
    wide = torch.full((3, 2 * num_heads * head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = wide[:, num_heads * head_dim :].view(3, num_heads, head_dim)
    batch.run(query=query, out=out, partition_size=128)
    assert_close(out, batch.reference(query), torch.bfloat16)
    assert torch.isnan(wide[:, : num_heads * head_dim]).all()  # nothing written outside out


def test_decode_empty_sequence_gives_zeros(gen):
    batch = PagedBatch(
        [0, 20, 0, 600], num_heads=8, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, gen=gen
    )
    for partition_size in (64, 512):
        out = batch.run(partition_size=partition_size)
        assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
        assert_close(out[[1, 3]], batch.reference()[[1, 3]], torch.float32)


def test_decode_workspace_argument(gen):
    batch = PagedBatch([1000, 5], num_heads=4, kv_heads=1, head_dim=64, block_size=16, dtype=torch.float16, gen=gen)
    size, parts = kernels.attention_partitions(2, 4, 1, 1000, partition_size=64)
    assert (size, parts) == (64, 16)
    workspace = torch.full((kernels.attention_workspace_numel(2, 4, 64, parts),), float("nan"), device=DEVICE)
    out = batch.run(partition_size=64, max_seq_len=1000, workspace=workspace)
    assert_close(out, batch.reference(), torch.float16)
    with pytest.raises(ValueError, match="workspace"):
        batch.run(partition_size=64, max_seq_len=1000, workspace=workspace[:10])


def test_decode_rejects_bad_arguments(gen):
    batch = PagedBatch([4], num_heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, gen=gen)
    with pytest.raises(ValueError, match="int32"):
        kernels.paged_attention_decode(
            nan_like(batch.query), batch.query, batch.cache, batch.block_tables.long(), batch.seq_lens_t, 1.0
        )
    with pytest.raises(ValueError, match="head_dim"):
        q = randn(1, 4, 80, gen=gen)
        kernels.paged_attention_decode(
            q.clone(), q, randn(2, 2, 16, 2, 80, gen=gen), batch.block_tables, batch.seq_lens_t, 1.0
        )
    with pytest.raises(ValueError, match="multiple"):
        q = randn(1, 3, 64, gen=gen)
        kernels.paged_attention_decode(q.clone(), q, batch.cache, batch.block_tables, batch.seq_lens_t, 1.0)


# ---- RMSNorm ---------------------------------------------------------------------------------------------

HIDDEN_SIZES = [576, 1000, 4096, 5120, 16384]  # 1000: not a multiple of 8, the scalar path


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("tokens", [1, 7, 333])
def test_rms_norm(dtype, hidden, tokens, gen):
    x = randn(tokens, hidden, gen=gen, dtype=dtype) * 3
    weight = randn(hidden, gen=gen, dtype=dtype)
    out = nan_like(x)
    kernels.rms_norm(out, x, weight, 1e-5)
    assert_close(out, rms_norm(x.double(), weight.double(), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_strided_and_in_place(dtype, gen):
    hidden = 4096
    wide = randn(33, hidden + 8, gen=gen, dtype=dtype)
    x = wide[:, :hidden]
    weight = randn(hidden, gen=gen, dtype=dtype)
    expected = rms_norm(x.double(), weight.double(), 1e-6)
    out = nan_like(x)
    kernels.rms_norm(out, x, weight, 1e-6)
    assert_close(out, expected, dtype)
    y = x.contiguous().view(3, 11, hidden)  # 3-d, normalised in place
    kernels.rms_norm(y, y, weight, 1e-6)
    assert_close(y.view(33, hidden), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("tokens", [1, 7, 333])
def test_fused_add_rms_norm(dtype, hidden, tokens, gen):
    x = randn(tokens, hidden, gen=gen, dtype=dtype)
    residual = randn(tokens, hidden, gen=gen, dtype=dtype) * 2
    weight = randn(hidden, gen=gen, dtype=dtype)
    expected_residual = residual + x  # rounded to dtype, as the model's x = x + attn(...)
    expected = rms_norm(expected_residual.double(), weight.double(), 1e-5)
    kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    assert_close(x, expected, dtype)


# ---- rotary embedding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (32, 8)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("tokens", [1, 7, 333])
def test_rotary_embedding(dtype, head_dim, heads, tokens, gen):
    num_heads, kv_heads = heads
    max_pos = 4096
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    cos, sin = rope_cos_sin_cache(rope_inv_freq(head_dim, 500000.0, scaling), max_pos)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=DEVICE)
    qkv = randn(tokens, (num_heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)  # strided views, as in the model
    k = qkv[:, num_heads * head_dim : (num_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (num_heads + kv_heads) * head_dim :].clone()
    expected_q = apply_rotary(q.double(), cos[positions], sin[positions])
    expected_k = apply_rotary(k.double(), cos[positions], sin[positions])
    kernels.rotary_embedding(positions, q, k, cos, sin)
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)
    assert torch.equal(qkv[:, (num_heads + kv_heads) * head_dim :], v_before)


def test_rotary_embedding_query_only_and_bad_position(gen):
    cos, sin = rope_cos_sin_cache(rope_inv_freq(64, 10000.0, {}), 100)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    q = randn(3, 4, 64, gen=gen)
    before = q.clone()
    positions = torch.tensor([5, 100, -1], device=DEVICE)  # the last two are out of range: untouched
    kernels.rotary_embedding(positions, q, None, cos, sin)
    assert_close(q[0], apply_rotary(before[:1].double(), cos[[5]], sin[[5]])[0], torch.float32)
    assert torch.equal(q[1:], before[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("tokens", [1, 7, 333])
def test_rotary_embedding_and_cache(dtype, head_dim, heads, tokens, gen):
    """The fused kernel equals rotary_embedding then reshape_and_cache bit for bit (and so the
    references): q and k rotated in place on the fused qkv views, the rotated k and the v stored
    at their slots, padding slots (-1) skipped, a position out of range left unrotated."""
    num_heads, kv_heads = heads
    block_size, num_blocks, max_pos = 16, 64, 4096
    cos, sin = rope_cos_sin_cache(rope_inv_freq(head_dim, 500000.0, {}), max_pos)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    if tokens > 1:
        slots[1] = -1  # padding
        positions[-1] = max_pos  # out of range: stored unrotated
    qkv = randn(tokens, (num_heads + 2 * kv_heads) * head_dim, gen=gen, dtype=dtype)
    cache = randn(2, num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)

    def views(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = buffer.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        return (
            q.view(tokens, num_heads, head_dim),
            k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim),
        )

    fused_qkv, fused_cache = qkv.clone(), cache.clone()
    q, k, v = views(fused_qkv)
    kernels.rotary_embedding_and_cache(positions, q, k, v, cos, sin, fused_cache, slots)
    two_qkv, two_cache = qkv.clone(), cache.clone()
    q2, k2, v2 = views(two_qkv)
    kernels.rotary_embedding(positions, q2, k2, cos, sin)
    kernels.reshape_and_cache(two_cache, k2, v2, slots)
    assert torch.equal(fused_qkv, two_qkv)
    assert torch.equal(fused_cache, two_cache)

    q0, k0, v0 = views(qkv)
    valid = (positions < max_pos).view(-1, 1, 1)
    clamped = positions.clamp(max=max_pos - 1)
    expected_q = torch.where(valid, apply_rotary(q0.double(), cos[clamped], sin[clamped]), q0.double())
    expected_k = torch.where(valid, apply_rotary(k0.double(), cos[clamped], sin[clamped]), k0.double())
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)
    expected_cache = cache.double().clone()
    keep = slots >= 0
    write_kv_cache(expected_cache, expected_k.to(dtype).double()[keep], v0.double()[keep], slots[keep])
    assert_close(fused_cache, expected_cache, dtype)


def test_rotary_embedding_and_cache_rejects_bad_arguments(gen):
    cos, sin = rope_cos_sin_cache(rope_inv_freq(64, 10000.0, {}), 100)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    q, k, v = randn(2, 4, 64, gen=gen), randn(2, 2, 64, gen=gen), randn(2, 2, 64, gen=gen)
    cache = randn(2, 4, 16, 2, 64, gen=gen)
    positions = torch.tensor([1, 2], device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.rotary_embedding_and_cache(positions, q, k, v, cos, sin, cache, slots[:1])
    with pytest.raises(ValueError, match="key"):
        kernels.rotary_embedding_and_cache(positions, q, randn(2, 3, 64, gen=gen), v, cos, sin, cache, slots)
    with pytest.raises(ValueError, match="dtype"):
        kernels.rotary_embedding_and_cache(positions, q, k, v, cos, sin, cache.half(), slots)


# ---- GEMV ----------------------------------------------------------------------------------------------------


GEMV_VARIANTS = ["", "b0", "b4", "b6", "s1_b4", "s2_b4", "s4_b4", "s4_b6"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n, k", [(1, 64), (7, 264), (4096, 4096), (5001, 4104), (4096, 14336), (6144, 4096)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("variant", GEMV_VARIANTS, ids=lambda v: v or "warp-per-row")
def test_gemv(dtype, n, k, with_bias, variant, gen):
    """Against float64 x @ w.T on the same rounded inputs, every build; odd row counts (a
    block's rows past N) and K not a multiple of the unrolled step (the remainder loop, the
    masked last round, warps of a split row with nothing to do). Rows are scaled by 1/sqrt(K)
    so every output is O(1) and the tolerance means the same for every K."""
    x = randn(1, k, gen=gen, dtype=dtype)
    weight = (randn(n, k, gen=gen) / math.sqrt(k)).to(dtype)
    bias = randn(n, gen=gen, dtype=dtype) if with_bias else None
    out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)
    kernels.gemv(out, x, weight, bias, variant=variant)
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert_close(out, expected, dtype)


def test_gemv_dispatch_and_rejects(gen):
    """ops.linear takes the GEMV for one aligned row and equals F.linear to rounding; every other
    shape goes to F.linear unchanged. gemv() itself rejects what it cannot take."""
    from zllm.workers.ops import linear

    weight = randn(300, 512, gen=gen, dtype=torch.bfloat16)
    x = randn(1, 512, gen=gen, dtype=torch.bfloat16)
    assert kernels.gemv_supported(x, weight)
    assert_close(linear(x, weight), torch.nn.functional.linear(x.double(), weight.double()), torch.bfloat16, scale=4)
    xs = randn(3, 512, gen=gen, dtype=torch.bfloat16)
    many = randn(9, 512, gen=gen, dtype=torch.bfloat16)  # 2-8 rows: gemv_rows (test_linear_routes_rows)
    assert torch.equal(linear(many, weight), torch.nn.functional.linear(many, weight))
    assert not kernels.gemv_supported(
        randn(1, 510, gen=gen, dtype=torch.bfloat16), randn(4, 510, gen=gen, dtype=torch.bfloat16)
    )
    assert not kernels.gemv_supported(x, weight.t().contiguous().t())  # non-contiguous rows
    with pytest.raises(ValueError, match="gemv"):
        kernels.gemv(torch.empty(1, 300, dtype=torch.bfloat16, device=DEVICE), xs, weight)
    with pytest.raises(ValueError, match="out"):
        kernels.gemv(torch.empty(1, 299, dtype=torch.bfloat16, device=DEVICE), x, weight)


# ---- GEMV for 2 to 8 rows -------------------------------------------------------------------------------------

# Llama-3-8B's projections (qkv, o, gate_up, down) and odd ones: N not a multiple of any build's
# rows a block (1, 7, 100, 5001), K a whole number of 16-byte units but not of a warp's 32-column
# chunks or rounds (64, 264, 4104: the masked last round, warps of a split with nothing to do).
GEMV_ROWS_SHAPES = [
    (1, 64),
    (7, 264),
    (100, 4104),
    (5001, 4104),
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
]
GEMV_ROWS_VARIANTS = [f"mma_g{g}_s{s}" for g in (1, 2) for s in (1, 2, 4)] + [f"fma_s{s}" for s in (1, 2, 4)]


def _rows_inputs(n, k, dtype, with_bias, gen):
    """8 rows of x and an [n, k] weight scaled by 1/sqrt(K), so every output is O(1) and the
    tolerance means the same for every K (as test_gemv)."""
    x = randn(8, k, gen=gen, dtype=dtype)
    weight = (randn(n, k, gen=gen) / math.sqrt(k)).to(dtype)
    bias = randn(n, gen=gen, dtype=dtype) if with_bias else None
    return x, weight, bias


def _check_rows(x, weight, bias, dtype, variant):
    """gemv_rows for m = 2 .. 8 of x's rows against float64 x @ w.T, each into the first m rows of
    a NaN buffer of 8 (a forgotten output stays NaN; a row past m written would not be). Every m
    gives the first rows the same bits: a row's result does not depend on the others."""
    n = weight.shape[0]
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    results = {}
    for m in range(2, 9):
        buffer = torch.full((8, n), float("nan"), dtype=dtype, device=DEVICE)
        kernels.gemv_rows(buffer[:m], x[:m], weight, bias, variant=variant)
        assert_close(buffer[:m], expected[:m], dtype)
        assert buffer[m:].isnan().all(), f"m={m}: rows past m written"
        results[m] = buffer[:m]
    for m, result in results.items():
        assert torch.equal(result, results[8][:m]), f"m={m}: rows differ from the same rows at m=8"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n, k", GEMV_ROWS_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_gemv_rows(dtype, n, k, with_bias, gen):
    """The default build (tensor cores for fp16/bf16, CUDA cores for fp32) for every m in 2..8."""
    _check_rows(*_rows_inputs(n, k, dtype, with_bias, gen), dtype, variant="")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n, k", [(7, 264), (100, 4104), (4096, 4096)])
@pytest.mark.parametrize("variant", GEMV_ROWS_VARIANTS)
def test_gemv_rows_builds(dtype, n, k, variant, gen):
    """Every build (the benchmark's and ZLLM_GEMV_ROWS_VARIANT's choices), with a bias."""
    if dtype == torch.float32 and variant.startswith("mma"):
        pytest.skip("no fp32 tensor-core build (it would be TF32)")
    _check_rows(*_rows_inputs(n, k, dtype, True, gen), dtype, variant=variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n, k", [(7, 264), (5001, 4104), (4096, 14336)])
def test_gemv_rows_fma_is_the_one_row_kernel_per_row(dtype, n, k, gen):
    """The CUDA-core build adds a row's products in the order of the one-row split kernel of the
    same split (gemv's default b6 build): the same bits, row by row."""
    x, weight, bias = _rows_inputs(n, k, dtype, True, gen)
    rows = kernels.gemv_rows(torch.empty(5, n, dtype=dtype, device=DEVICE), x[:5], weight, bias, variant="fma")
    for i in range(5):
        one = kernels.gemv(torch.empty(1, n, dtype=dtype, device=DEVICE), x[i : i + 1], weight, bias, variant="b6")
        assert torch.equal(rows[i : i + 1], one), f"row {i}"


def test_gemv_rows_rejects(gen):
    weight = randn(300, 512, gen=gen, dtype=torch.bfloat16)
    x = randn(4, 512, gen=gen, dtype=torch.bfloat16)
    assert kernels.gemv_rows_supported(x, weight)
    assert not kernels.gemv_rows_supported(x[:1], weight)  # one row: gemv
    assert not kernels.gemv_rows_supported(randn(9, 512, gen=gen, dtype=torch.bfloat16), weight)
    assert not kernels.gemv_rows_supported(x, weight.t().contiguous().t())  # non-contiguous rows
    assert not kernels.gemv_rows_supported(x[:, :510], weight[:, :510])  # K not whole 16-byte units
    assert not kernels.gemv_rows_supported(x.float(), weight)
    with pytest.raises(ValueError, match="gemv_rows"):
        kernels.gemv_rows(
            torch.empty(9, 300, dtype=torch.bfloat16, device=DEVICE), randn(9, 512, gen=gen).bfloat16(), weight
        )
    with pytest.raises(ValueError, match="out"):
        kernels.gemv_rows(torch.empty(4, 299, dtype=torch.bfloat16, device=DEVICE), x, weight)
    with pytest.raises(ValueError, match="out"):
        kernels.gemv_rows(torch.empty(3, 300, dtype=torch.bfloat16, device=DEVICE), x, weight)
    with pytest.raises(ValueError, match="bias"):
        kernels.gemv_rows(torch.empty(4, 300, dtype=torch.bfloat16, device=DEVICE), x, weight, x[0, :299])
    with pytest.raises(ValueError, match="dtype"):
        kernels.gemv_rows(torch.empty(4, 300, dtype=torch.float16, device=DEVICE), x, weight)
    with pytest.raises(ValueError, match="variant"):
        kernels.gemv_rows(torch.empty(4, 300, dtype=torch.bfloat16, device=DEVICE), x, weight, variant="mma_g4_s1")


def test_linear_routes_rows(monkeypatch, gen):
    """ops.linear: 1 row to gemv, 2..8 rows to gemv_rows (equal to a direct call, bit for bit, and
    to float64 to rounding), 9 rows to cuBLAS unchanged; ZLLM_GEMV_ROWS=0 (GEMV_ROWS_ENABLED) and
    ZLLM_GEMV=0 send 2..8 rows to cuBLAS."""
    from zllm.workers import ops

    calls = []
    real = kernels.gemv_rows
    monkeypatch.setattr(kernels, "gemv_rows", lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    weight = randn(4096, 4096, gen=gen, dtype=torch.bfloat16) / 64
    bias = randn(4096, gen=gen, dtype=torch.bfloat16)
    for m in range(2, 9):
        x = randn(m, 4096, gen=gen, dtype=torch.bfloat16)
        got = ops.linear(x, weight, bias)
        assert calls[-1:] == [m]
        assert torch.equal(got, real(torch.empty(m, 4096, dtype=torch.bfloat16, device=DEVICE), x, weight, bias))
        assert_close(got, torch.nn.functional.linear(x.double(), weight.double(), bias.double()), torch.bfloat16)
    calls.clear()
    x9 = randn(9, 4096, gen=gen, dtype=torch.bfloat16)
    assert torch.equal(ops.linear(x9, weight, bias), torch.nn.functional.linear(x9, weight, bias))
    ops.linear(x9[:1], weight, bias)  # one row: gemv, not gemv_rows
    assert calls == []
    x5 = x9[:5]
    for switch in ("GEMV_ROWS_ENABLED", "GEMV_ENABLED"):
        with monkeypatch.context() as patch:
            patch.setattr(ops, switch, False)
            assert torch.equal(ops.linear(x5, weight, bias), torch.nn.functional.linear(x5, weight, bias))
    assert calls == []


def test_gemv_rows_in_a_cuda_graph(gen):
    """ops.linear on 5 rows (a verifying step: 1 + 4 drafts) captured with its output allocated in
    the capture, replayed with new inputs: each replay equals the eager call bit for bit."""
    from zllm.workers import ops

    kernels.preload()
    weights = [randn(n, 4096, gen=gen, dtype=torch.bfloat16) / 64 for n in (6144, 4096)]
    x = randn(5, 4096, gen=gen, dtype=torch.bfloat16)

    def step():
        return [ops.linear(x, w) for w in weights]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        x.copy_(randn(5, 4096, gen=gen, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        for out, eager in zip(outs, step(), strict=True):
            assert torch.equal(out, eager)


# ---- SiLU and mul -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("size", [7, 1001, 4096, 14336])
@pytest.mark.parametrize("tokens", [1, 7, 333])
def test_silu_and_mul(dtype, size, tokens, gen):
    x = randn(tokens, 2 * size, gen=gen, dtype=dtype) * 3
    out = torch.full((tokens, size), float("nan"), dtype=dtype, device=DEVICE)
    kernels.silu_and_mul(out, x)
    assert_close(out, silu_and_mul(x.double()), dtype)


def test_silu_and_mul_strided(gen):
    wide = randn(9, 2 * 512 + 5, gen=gen, dtype=torch.bfloat16)
    x = wide[:, : 2 * 512]
    out = torch.full((9, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    kernels.silu_and_mul(out, x)
    assert_close(out, silu_and_mul(x.double()), torch.bfloat16)


# ---- CUDA graphs ---------------------------------------------------------------------------------------------


def test_cuda_graph_capture_and_replay(gen):
    """reshape_and_cache + paged_attention_decode (split-K) + rms_norm captured once, replayed with
    new inputs; each replay equals the same calls run eagerly, and the reference."""
    dtype, num_heads, kv_heads, head_dim, block_size, hidden = torch.bfloat16, 8, 2, 128, 16, 1024
    batch, max_blocks, num_blocks = 4, 64, 300  # capacity 1024 tokens: 2+ partitions
    kv_cache = randn(2, num_blocks, block_size, kv_heads, head_dim, gen=gen, dtype=dtype)
    key = randn(batch, kv_heads, head_dim, gen=gen, dtype=dtype)
    value = randn(batch, kv_heads, head_dim, gen=gen, dtype=dtype)
    query = randn(batch, num_heads, head_dim, gen=gen, dtype=dtype)
    slots = torch.zeros(batch, dtype=torch.int64, device=DEVICE)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.ones(batch, dtype=torch.int32, device=DEVICE)
    x = randn(batch, hidden, gen=gen, dtype=dtype)
    weight = randn(hidden, gen=gen, dtype=dtype)
    attn_out = nan_like(query)
    norm_out = nan_like(x)
    scale = head_dim**-0.5

    def step() -> None:
        kernels.reshape_and_cache(kv_cache, key, value, slots)
        kernels.paged_attention_decode(attn_out, query, kv_cache, tables, seq_lens, scale, partition_size=256)
        kernels.rms_norm(norm_out, x, weight, 1e-5)

    def new_inputs() -> list[int]:
        lens = torch.randint(1, max_blocks * block_size + 1, (batch,), generator=gen, device=DEVICE).tolist()
        pool = torch.randperm(num_blocks, generator=gen, device=DEVICE).tolist()
        tables.zero_()
        for i, n in enumerate(lens):
            ids = [pool.pop() for _ in range(-(-n // block_size))]
            tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
            slots[i] = ids[(n - 1) // block_size] * block_size + (n - 1) % block_size  # the new token's slot
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        for t in (key, value, query, x):
            t.copy_(randn(*t.shape, gen=gen, dtype=dtype))
        return lens

    new_inputs()
    kernels.preload()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: loads modules, sizes the workspace
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for _ in range(3):
        lens = new_inputs()
        cache_before = kv_cache.clone()
        attn_out.fill_(float("nan"))
        norm_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        graph_attn, graph_norm, graph_cache = attn_out.clone(), norm_out.clone(), kv_cache.clone()

        kv_cache.copy_(cache_before)
        attn_out.fill_(float("nan"))
        norm_out.fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        assert torch.equal(graph_cache, kv_cache)
        assert torch.equal(graph_attn, attn_out)
        assert torch.equal(graph_norm, norm_out)

        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables.long(),
            seq_lens=seq_lens.long(),
            seq_lens_list=lens,
            query_start_loc=list(range(batch + 1)),
            num_decodes=batch,
            block_size=block_size,
        )
        assert_close(graph_attn, paged_attention(query.double(), kv_cache.double(), meta, scale), dtype)
        assert_close(graph_norm, rms_norm(x.double(), weight.double(), 1e-5), dtype)


# ---- loading ---------------------------------------------------------------------------------------------------


def test_prebuilt_and_nvrtc_modules_agree(monkeypatch, gen):
    """Both load paths run the same source: identical results. The prebuilt half is skipped
    without a build (scripts/build_csrc.sh) for this GPU."""
    capability = torch.cuda.get_device_capability()
    x = randn(5, 1000, gen=gen, dtype=torch.bfloat16)
    weight = randn(1000, gen=gen, dtype=torch.bfloat16)
    results = {}
    modes = ["nvrtc"] + (["prebuilt"] if loader.prebuilt_candidates("layernorm_kernels", capability) else [])
    try:
        for mode in modes:
            monkeypatch.setenv("ZLLM_KERNELS", mode)
            loader.reset()
            origin = loader.load_module("layernorm_kernels", torch.cuda.current_device()).origin
            assert origin.startswith(mode)
            results[mode] = kernels.rms_norm(nan_like(x), x, weight, 1e-5)
    finally:
        monkeypatch.undo()
        loader.reset()
    for result in results.values():
        assert_close(result, results["nvrtc"], torch.bfloat16)
    assert_close(results["nvrtc"], rms_norm(x.double(), weight.double(), 1e-5), torch.bfloat16)
    print("kernel modules:", kernels.preload())
