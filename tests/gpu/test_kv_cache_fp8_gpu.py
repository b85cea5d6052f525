"""The FP8 KV cache on the GPU: the fused rotary-and-cache kernel stores exactly what
attention.quantize_kv computes; decode attention over an FP8 cache matches the float64 reference
over the dequantized cache; and the engine with --kv-cache-dtype fp8 matches transformers on the
same GPU with its keys and values rounded the same way (fp32, graphs), holds twice the blocks,
and its graphs equal eager."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.fp8 import fp8_kv_rounding  # noqa: E402
from tests.helpers.gpu import MAX_TOKENS, engine_tokens, record, share_identical  # noqa: E402
from tests.helpers.kernels import DEVICE, DTYPE_IDS, DTYPES, PagedBatch, assert_close, randn  # noqa: E402
from tests.helpers.models import save_tiny_model  # noqa: E402
from zllm.workers import kernels  # noqa: E402
from zllm.workers.attention import KV_FP8, KVScales, dequantize_kv, quantize_kv  # noqa: E402
from zllm.workers.layers import rope_cos_sin_cache, rope_inv_freq  # noqa: E402

pytestmark = pytest.mark.gpu

# Cached values are ~6 randn: 0.05 keeps x / s mostly inside E4M3's ±448, so the value scale is
# tested as a scale, not only through saturation.
SCALES = [KVScales(), KVScales(0.37, 0.05)]
SCALE_IDS = ["unscaled", "scaled"]


# ---- kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scales", SCALES, ids=SCALE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_and_cache_stores_quantize_kv_bit_for_bit(dtype, scales, head_dim, gen):
    tokens, num_heads, kv_heads, block_size, num_blocks, max_pos = 37, 8, 2, 16, 16, 4096
    cos, sin = (t.to(DEVICE) for t in rope_cos_sin_cache(rope_inv_freq(head_dim, 500000.0, {}), max_pos))
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    slots[3] = -1  # padding: nothing stored
    # Values up to ~30 / scale: past 448 after the scale, so saturation is exercised too.
    qkv = randn(tokens, (num_heads + 2 * kv_heads) * head_dim, gen=gen) * 8
    qkv = qkv.to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=KV_FP8, device=DEVICE)
    kernels.rotary_embedding_and_cache(positions, q, k, v, cos, sin, cache, slots, scales.k, scales.v)

    keep = slots >= 0
    stored = cache.view(torch.uint8).view(2, -1, kv_heads, head_dim)
    assert torch.equal(stored[0, slots[keep]], quantize_kv(k[keep], scales.k).view(torch.uint8))  # k: rotated in place
    assert torch.equal(stored[1, slots[keep]], quantize_kv(v[keep], scales.v).view(torch.uint8))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[keep]] = False
    assert not stored[:, untouched].any()


def _fp8_batch(lens, dtype, gen, scales, **shape) -> tuple[PagedBatch, torch.Tensor]:
    """A PagedBatch whose cache is FP8 (NaN outside the sequences, as before), and the float64
    reference over its dequantized clean copy."""
    batch = PagedBatch(lens, dtype=dtype, gen=gen, **shape)
    fp8 = torch.stack([quantize_kv(batch.cache[0] * 6, scales.k), quantize_kv(batch.cache[1] * 6, scales.v)])
    clean = torch.stack(
        [quantize_kv(batch.clean_cache[0] * 6, scales.k), quantize_kv(batch.clean_cache[1] * 6, scales.v)]
    )
    batch.cache = fp8
    batch.clean_cache = torch.stack(
        [dequantize_kv(clean[0], scales.k, torch.float64), dequantize_kv(clean[1], scales.v, torch.float64)]
    )
    return batch, batch.reference()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("scales", SCALES, ids=SCALE_IDS)
def test_decode_over_fp8_cache(dtype, head_dim, group, scales, gen):
    batch, expected = _fp8_batch(
        [1, 15, 16, 17, 33, 257, 1000],
        dtype,
        gen,
        scales,
        num_heads=2 * group,
        kv_heads=2,
        head_dim=head_dim,
        block_size=16,
    )
    run = lambda **kw: kernels.paged_attention_decode(  # noqa: E731
        torch.full_like(batch.query, float("nan")),
        batch.query,
        batch.cache,
        batch.block_tables,
        batch.seq_lens_t,
        batch.scale,
        k_scale=scales.k,
        v_scale=scales.v,
        **kw,
    )
    # Cached values ~6x those of test_kernels' (to span E4M3's range) make 6x larger scores, whose
    # softmax magnifies fp32's rounding as much: the fp32 tolerance grows with them.
    tolerance = 6.0 if dtype == torch.float32 else 1.0
    assert_close(run(), expected, dtype, tolerance)
    assert_close(run(partition_size=64, max_seq_len=1000), expected, dtype, tolerance)  # split-K and its reduce


def test_fp8_cache_argument_checks(gen):
    batch, _ = _fp8_batch([4], torch.bfloat16, gen, SCALES[0], num_heads=4, kv_heads=2, head_dim=64, block_size=16)
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match="k_scale must be finite and positive"):
        kernels.paged_attention_decode(
            out, batch.query, batch.cache, batch.block_tables, batch.seq_lens_t, 1.0, k_scale=0.0
        )
    with pytest.raises(ValueError, match="expected torch.bfloat16 or torch.float8_e4m3fn"):
        kernels.paged_attention_decode(
            out, batch.query, batch.cache.view(torch.int8), batch.block_tables, batch.seq_lens_t, 1.0
        )


# ---- the engine ---------------------------------------------------------------------------------

ENGINE_SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    rope_theta=500000.0,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvfp8")
    save_tiny_model(
        directory, "llama", vocab_size=256, max_position_embeddings=4096, initializer_range=0.2, **ENGINE_SHAPE
    )
    return str(directory)


@pytest.fixture(scope="module")
def prompt_ids():
    import random

    rng = random.Random(1)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in [1, 3, 16, 17, 40, 129, 400]]


def _hf_rounded_tokens(model_dir, prompt_ids, dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    with fp8_kv_rounding(model), torch.inference_mode():
        for ids in prompt_ids:
            generated = model.generate(
                torch.tensor([ids], device="cuda"),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=model.generation_config.eos_token_id,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
            )
            out.append(generated[0, len(ids) :].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def test_fp32_engine_with_fp8_cache_equals_rounded_transformers(model_dir, prompt_ids):
    ours = engine_tokens(model_dir, prompt_ids, dtype="float32", kv_cache_dtype="fp8")
    theirs = _hf_rounded_tokens(model_dir, prompt_ids, torch.float32)
    record("kvfp8_fp32_share_identical", share_identical(ours, theirs))
    assert ours == theirs
    assert ours != engine_tokens(model_dir, prompt_ids, dtype="float32")  # the rounding shows at this size


def test_bf16_engine_with_fp8_cache(model_dir, prompt_ids):
    """Packed FlashAttention prefill over the dequantized cache; graphs equal eager; the first
    token agrees with rounded transformers in bf16 (later ones drift, as in bf16 without FP8)."""
    # Steps with prefill off the graphs (mixed_graph_max_tokens=0, the pieces off): the decode
    # graphs alone replay eager bit for bit.
    graphs = engine_tokens(
        model_dir,
        prompt_ids,
        dtype="bfloat16",
        kv_cache_dtype="fp8",
        mixed_graph_max_tokens=0,
        piecewise_cuda_graphs=False,
    )
    eager = engine_tokens(model_dir, prompt_ids, dtype="bfloat16", kv_cache_dtype="fp8", enforce_eager=True)
    assert graphs == eager
    theirs = _hf_rounded_tokens(model_dir, prompt_ids, torch.bfloat16)
    first_agree = sum(a[0] == b[0] for a, b in zip(graphs, theirs))
    record("kvfp8_bf16_first_token_agreement", f"{first_agree}/{len(graphs)}")
    record("kvfp8_bf16_share_identical", share_identical(graphs, theirs))
    assert first_agree >= 0.75 * len(graphs)


def test_fp8_cache_holds_twice_the_blocks(model_dir):
    from zllm import LLMEngine

    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        engine = LLMEngine.from_engine_args(
            model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, kv_cache_dtype=kv_dtype
        )
        try:
            blocks[kv_dtype] = engine.core.num_kv_blocks
            assert {c.dtype for c in engine.core.executor.runner.kv_caches} == {
                KV_FP8 if kv_dtype == "fp8" else torch.bfloat16
            }
        finally:
            engine.shutdown()
    record("kvfp8_blocks_at_0.3", blocks)
    assert abs(blocks["fp8"] / blocks["auto"] - 2) < 0.01, blocks
