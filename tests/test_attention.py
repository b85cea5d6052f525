"""The paged reference attention against a dense softmax(q k^T * scale + causal mask) v (with
sliding windows and soft-capped scores too), and the rotary embedding (default, llama3, linear,
LongRoPE, partial), Gemma's norm and GeGLU against HF transformers' implementations."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from zllm.workers.attention import AttentionMetadata, pack_prefill, packed_prefill_of, paged_attention, write_kv_cache
from zllm.workers.layers import apply_rotary, rope_cos_sin_cache, rope_inv_freq

BLOCK_SIZE = 16
NUM_BLOCKS = 48
NUM_HEADS = 8
NUM_KV_HEADS = 2
HEAD_DIM = 32
SCALE = 1.0 / math.sqrt(HEAD_DIM)


# ---- paged cache helpers ----------------------------------------------------------------------


@dataclass
class Req:
    context_len: int  # tokens in the cache after this step
    query_len: int  # new tokens this step (the last query_len of the context)
    keys: torch.Tensor | None = None  # [context_len, kv_heads, head_dim]
    values: torch.Tensor | None = None
    query: torch.Tensor | None = None  # [query_len, heads, head_dim]
    block_ids: list[int] | None = None

    @property
    def cached_len(self) -> int:
        return self.context_len - self.query_len

    def slots(self, start: int, end: int) -> list[int]:
        return [self.block_ids[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(start, end)]


def fill_requests(reqs: list[Req], generator: torch.Generator) -> None:
    """Random K/V/Q for each request and blocks drawn from a shuffled pool (never contiguous)."""
    pool = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    for req in reqs:
        req.keys = torch.randn(req.context_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        req.values = torch.randn(req.context_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        req.query = torch.randn(req.query_len, NUM_HEADS, HEAD_DIM, generator=generator)
        num_blocks = -(-req.context_len // BLOCK_SIZE)
        req.block_ids = [pool.pop() for _ in range(num_blocks)]


def build_metadata(reqs: list[Req]) -> AttentionMetadata:
    """What the model runner builds: decodes first, block tables padded with zeros."""
    num_decodes = sum(1 for r in reqs if r.query_len == 1)
    assert all(r.query_len == 1 for r in reqs[:num_decodes]), "decodes must come first"
    width = max(len(r.block_ids) for r in reqs)
    block_tables = torch.zeros(len(reqs), width, dtype=torch.long)
    for row, req in enumerate(reqs):
        block_tables[row, : len(req.block_ids)] = torch.tensor(req.block_ids)
    query_start_loc = [0]
    for req in reqs:
        query_start_loc.append(query_start_loc[-1] + req.query_len)
    slots = [s for r in reqs for s in r.slots(r.cached_len, r.context_len)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=block_tables,
        seq_lens=torch.tensor([r.context_len for r in reqs], dtype=torch.long),
        seq_lens_list=[r.context_len for r in reqs],
        query_start_loc=query_start_loc,
        num_decodes=num_decodes,
        block_size=BLOCK_SIZE,
    )


def new_cache(generator: torch.Generator) -> torch.Tensor:
    # Garbage everywhere: a slot that is read but should not be would show in the result.
    return 100.0 * torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)


def write_step(kv_cache: torch.Tensor, reqs: list[Req], meta: AttentionMetadata) -> None:
    """The cached prefixes (as earlier steps wrote them), then this step's new tokens via slot_mapping."""
    for req in reqs:
        if req.cached_len:
            slots = torch.tensor(req.slots(0, req.cached_len))
            write_kv_cache(kv_cache, req.keys[: req.cached_len], req.values[: req.cached_len], slots)
    new_keys = torch.cat([r.keys[r.cached_len :] for r in reqs])
    new_values = torch.cat([r.values[r.cached_len :] for r in reqs])
    write_kv_cache(kv_cache, new_keys, new_values, meta.slot_mapping)


def dense_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v for one request, in float64. The queries are the last
    query_len positions of the context; kv heads are repeated for GQA (head h uses kv head
    h // (heads / kv_heads), as HF's repeat_kv). window: query p sees keys p - window < j <= p;
    softcap: scores capped at softcap * tanh(scores / softcap) (HF's eager Gemma 2)."""
    q, k, v = query.double(), keys.double(), values.double()
    query_len, context_len = q.shape[0], k.shape[0]
    repeat = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(repeat, dim=1)  # [L, H, D]
    v = v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(context_len - query_len, context_len)
    causal = torch.arange(context_len)[None, :] <= positions[:, None]  # [Q, L]
    if window is not None:
        causal &= positions[:, None] - torch.arange(context_len)[None, :] < window
    scores = scores.masked_fill(~causal[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def run_paged(reqs: list[Req], seed: int, **layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged output, dense reference), both [total query tokens, heads, head_dim]; layer: the
    window and softcap of both."""
    generator = torch.Generator().manual_seed(seed)
    fill_requests(reqs, generator)
    meta = build_metadata(reqs)
    kv_cache = new_cache(generator)
    write_step(kv_cache, reqs, meta)
    query = torch.cat([r.query for r in reqs])
    out = paged_attention(query, kv_cache, meta, SCALE, **layer)
    reference = torch.cat([dense_attention(r.query, r.keys, r.values, SCALE, **layer) for r in reqs])
    return out, reference


# ---- paged attention --------------------------------------------------------------------------


def test_write_kv_cache_puts_each_token_at_its_slot():
    generator = torch.Generator().manual_seed(0)
    reqs = [Req(context_len=37, query_len=37), Req(context_len=5, query_len=5)]
    fill_requests(reqs, generator)
    meta = build_metadata(reqs)
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    write_step(kv_cache, reqs, meta)
    for req in reqs:
        for t in range(req.context_len):
            block, offset = req.block_ids[t // BLOCK_SIZE], t % BLOCK_SIZE
            assert torch.equal(kv_cache[0, block, offset], req.keys[t])
            assert torch.equal(kv_cache[1, block, offset], req.values[t])


MIXED_BATCH = [
    # decodes (one query token), first
    (37, 1),  # third block, crosses two boundaries
    (17, 1),  # first token of the second block
    (5, 1),  # a single partial block
    (64 + 9, 1),  # five blocks
    # prefills with a cached prefix: the queries are the last tokens of the context
    (50, 13),  # queries 37..49, crossing the boundary at 48
    (70, 40),  # queries 30..69, three boundaries inside the query run
    (33, 2),  # a short chunk right after a boundary
    # prefill from scratch
    (21, 21),
]


def test_paged_attention_matches_dense_on_mixed_batch():
    reqs = [Req(context_len, query_len) for context_len, query_len in MIXED_BATCH]
    out, reference = run_paged(reqs, seed=1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "batch",
    [
        [(19, 1)],  # one decode only
        [(3, 1), (40, 1), (16 + 15, 1)],  # decodes only
        [(45, 45)],  # one prefill from scratch
        [(47, 30), (18, 18)],  # prefills only
        [(1, 1), (2, 2)],  # a decode of a one-token context, a two-token prefill
    ],
    ids=["single-decode", "decodes", "single-prefill", "prefills", "tiny"],
)
def test_paged_attention_matches_dense_on_edge_batches(batch):
    reqs = [Req(context_len, query_len) for context_len, query_len in batch]
    out, reference = run_paged(reqs, seed=2)
    torch.testing.assert_close(out, reference.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 29, 200])
@pytest.mark.parametrize("softcap", [None, 1.5], ids=["no-cap", "cap"])
def test_paged_attention_window_and_softcap_match_dense(window, softcap):
    """Windows shorter than one block, of a block, across blocks and longer than every context,
    with and without capped scores, over decodes, chunks with a cached prefix and whole prompts."""
    reqs = [Req(context_len, query_len) for context_len, query_len in MIXED_BATCH]
    out, reference = run_paged(reqs, seed=5, window=window, softcap=softcap)
    torch.testing.assert_close(out, reference.float(), atol=1e-5, rtol=0)
    if window < 70:  # the window reaches into the longest contexts: it changes their attention
        plain, _ = run_paged([Req(context_len, query_len) for context_len, query_len in MIXED_BATCH], seed=5)
        assert not torch.allclose(out, plain, atol=1e-3)


def test_capped_attention_in_query_row_chunks_is_the_same(monkeypatch):
    """A long capped prefill is attended in chunks of query rows (bounding the score matrix):
    the same result as in one piece."""
    from zllm.workers import attention

    reqs = [Req(context_len, query_len) for context_len, query_len in MIXED_BATCH]
    whole, reference = run_paged(reqs, seed=6, window=20, softcap=2.0)
    monkeypatch.setattr(attention, "_CAPPED_ROWS", 3)
    chunked, _ = run_paged(
        [Req(context_len, query_len) for context_len, query_len in MIXED_BATCH], seed=6, window=20, softcap=2.0
    )
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked, reference.float(), atol=1e-5, rtol=0)


def test_paged_attention_ignores_other_requests_and_padding():
    # The same request alone and in a batch with longer neighbours (so its block-table row is padded
    # and the gathered context runs past its length) gives the same result.
    target = (29, 1)
    alone, _ = run_paged([Req(*target)], seed=3)
    batch = [Req(*target), Req(90, 1), Req(40, 7)]
    mixed, reference = run_paged(batch, seed=3)  # same seed: the target's data is drawn first
    torch.testing.assert_close(mixed[:1], alone, atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed, reference.float(), atol=1e-5, rtol=0)


def test_packed_prefill_gathers_every_context_token_of_the_prefills_in_order():
    """The packed layout the GPU's one-call prefill attention reads (tests/gpu checks the call):
    after the decodes, each prefill request's whole context (cached prefix and new tokens) in
    order, with its query and key offsets."""
    generator = torch.Generator().manual_seed(7)
    reqs = [
        Req(context_len=40, query_len=1),
        Req(context_len=3, query_len=1),
        Req(context_len=37, query_len=37),
        Req(context_len=50, query_len=18),
        Req(context_len=17, query_len=2),
        Req(context_len=16, query_len=16),
    ]
    fill_requests(reqs, generator)
    meta = build_metadata(reqs)
    kv_cache = new_cache(generator)
    write_step(kv_cache, reqs, meta)
    slots, cu = pack_prefill(
        meta.block_tables.numpy(), meta.seq_lens_list, meta.query_start_loc, meta.num_decodes, BLOCK_SIZE
    )
    prefill = packed_prefill_of(
        torch.from_numpy(slots), torch.from_numpy(cu), meta.seq_lens_list, meta.query_start_loc, meta.num_decodes
    )
    prefills = reqs[meta.num_decodes :]
    keys = kv_cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM).index_select(0, prefill.context_slots)
    values = kv_cache[1].view(-1, NUM_KV_HEADS, HEAD_DIM).index_select(0, prefill.context_slots)
    assert torch.equal(keys, torch.cat([r.keys for r in prefills]))
    assert torch.equal(values, torch.cat([r.values for r in prefills]))
    assert prefill.cu_seq_q.dtype == prefill.cu_seq_k.dtype == torch.int32
    assert prefill.cu_seq_q.tolist() == [0, 37, 55, 57, 73]
    assert prefill.cu_seq_k.tolist() == [0, 37, 87, 104, 120]
    assert (prefill.max_q, prefill.max_k) == (37, 50)


def test_dense_reference_is_plain_softmax_attention():
    # Guard for the reference itself: one query at the last position of a 3-token context, MHA.
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 4, generator=generator)
    k = torch.randn(3, 1, 4, generator=generator)
    v = torch.randn(3, 1, 4, generator=generator)
    weights = (q[0, 0].double() @ k[:, 0].double().T * 0.5).softmax(dim=-1)
    expected = weights @ v[:, 0].double()
    torch.testing.assert_close(dense_attention(q, k, v, 0.5)[0, 0], expected)


# ---- rotary embedding vs HF transformers ---------------------------------------------------------


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def llama_config(rope_parameters: dict, head_dim: int = 64) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=131072 if rope_parameters["rope_type"] == "llama3" else 4096,
        rope_parameters=dict(rope_parameters),
    )


def zllm_inv_freq(config: LlamaConfig) -> torch.Tensor:
    params = dict(config.rope_parameters)
    theta = params.pop("rope_theta")
    return rope_inv_freq(config.head_dim, theta, params)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_llama3_inv_freq_matches_transformers(head_dim):
    config = llama_config(LLAMA3_ROPE, head_dim)
    assert config.rope_parameters["rope_type"] == "llama3"
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    assert attention_factor == 1.0
    ours = zllm_inv_freq(config)
    assert ours.dtype == expected.dtype == torch.float32
    assert torch.equal(ours, expected)
    # The scaling did something: low frequencies slowed down, the highest kept.
    plain = rope_inv_freq(head_dim, LLAMA3_ROPE["rope_theta"], {})
    assert ours[0] == plain[0] and (ours[-1] < plain[-1])


def test_default_inv_freq_matches_transformers():
    config = llama_config(DEFAULT_ROPE)
    expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    assert torch.equal(zllm_inv_freq(config), expected)


def test_unsupported_rope_type_is_rejected():
    with pytest.raises(ValueError, match="rope_type"):
        rope_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 4.0})


YARN_VARIANTS = {
    "plain": {"factor": 8.0},  # attention factor mscale(8)
    "deepseek": {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "gpt-oss": {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    "given-factor": {"factor": 4.0, "attention_factor": 1.25},
}


@pytest.mark.parametrize("variant", sorted(YARN_VARIANTS))
def test_yarn_matches_transformers(variant):
    """YaRN's frequencies (ramp between beta_fast and beta_slow, truncated or not) and attention
    factor (mscale, DeepSeek's mscale / mscale_all_dim, or given) are transformers' bit for bit."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 512,
        **YARN_VARIANTS[variant],
    }
    config = llama_config(rope)
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours, factor = _inv_freq_of(config)
    assert torch.equal(ours, expected)
    assert factor == pytest.approx(expected_factor, rel=1e-15)


@pytest.mark.parametrize("rope", [DEFAULT_ROPE, LLAMA3_ROPE], ids=["default", "llama3"])
def test_apply_rotary_matches_transformers(rope):
    config = llama_config(rope)
    generator = torch.Generator().manual_seed(5)
    num_tokens, max_positions = 37, 20000
    # Positions as in a batch: unsorted, repeated, and far ones where float32 rounding matters.
    positions = torch.randint(0, max_positions, (num_tokens,), generator=generator)
    positions[:3] = torch.tensor([0, 1, max_positions - 1])
    q = torch.randn(num_tokens, config.num_attention_heads, config.head_dim, generator=generator)
    k = torch.randn(num_tokens, config.num_key_value_heads, config.head_dim, generator=generator)

    cos_cache, sin_cache = rope_cos_sin_cache(zllm_inv_freq(config), max_positions)
    ours_q = apply_rotary(q, cos_cache[positions], sin_cache[positions])
    ours_k = apply_rotary(k, cos_cache[positions], sin_cache[positions])

    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(q, positions[None, :])  # [1, tokens, head_dim]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)  # [1, H, T, D]
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))


# ---- the variations of Gemma and Phi-3 vs HF transformers ----------------------------------------


def _inv_freq_of(config, **kwargs) -> tuple[torch.Tensor, float]:
    """zllm's inverse frequencies and attention factor for an HF config's rope_parameters."""
    from zllm.workers.layers import rope_attention_factor

    params = dict(config.rope_parameters)
    theta = params.pop("rope_theta")
    rotary_dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    ours = rope_inv_freq(rotary_dim, theta, params, **kwargs)
    return ours, rope_attention_factor(params, config.max_position_embeddings)


def phi3_config(**overrides):
    from transformers import Phi3Config

    settings = dict(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=4096,
        original_max_position_embeddings=256,
        pad_token_id=0,
        partial_rotary_factor=0.5,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.9, 3.0], "long_factor": [2, 5, 11, 30.0]},
    )
    settings.update(overrides)
    return Phi3Config(**settings)


@pytest.mark.parametrize("long_context", [False, True], ids=["short", "long"])
def test_longrope_matches_transformers(long_context):
    from zllm.workers.layers import rope_uses_long_factors

    config = phi3_config()
    seq_len = 257 if long_context else 256  # HF's switch: the sequence is longer than the original
    expected, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
    ours, factor = _inv_freq_of(config, long_context=long_context)
    assert torch.equal(ours, expected)
    assert factor == expected_factor == pytest.approx(math.sqrt(1 + math.log(16) / math.log(256)))
    params = config.rope_parameters
    assert rope_uses_long_factors(params, 257) and not rope_uses_long_factors(params, 256)
    assert not rope_uses_long_factors({"rope_type": "default"}, 10**6)


def test_linear_rope_matches_transformers():
    config = llama_config({"rope_type": "linear", "rope_theta": 10000.0, "factor": 8.0})
    expected, _ = ROPE_INIT_FUNCTIONS["linear"](config)
    ours, factor = _inv_freq_of(config)
    assert torch.equal(ours, expected) and factor == 1.0


def test_partial_rotary_with_attention_factor_matches_phi3():
    """Phi-4-mini's rotary: half of each head rotated by LongRoPE with its attention factor, the
    other half passed through."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

    config = phi3_config()
    generator = torch.Generator().manual_seed(6)
    positions = torch.randint(0, 200, (23,), generator=generator)
    q = torch.randn(23, 4, 16, generator=generator)
    k = torch.randn(23, 2, 16, generator=generator)
    inv_freq, factor = _inv_freq_of(config)
    cos_cache, sin_cache = rope_cos_sin_cache(inv_freq, 256, factor)
    ours_q = apply_rotary(q, cos_cache[positions], sin_cache[positions])
    ours_k = apply_rotary(k, cos_cache[positions], sin_cache[positions])
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None, :])
    hf_q, hf_k = phi3_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), atol=1e-6, rtol=0)
    assert torch.equal(ours_q[..., 8:], q[..., 8:]) and factor > 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gemma_norm_and_geglu_match_transformers(dtype):
    from transformers.activations import ACT2FN
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from zllm.workers.layers import gelu_tanh_and_mul, rms_norm

    generator = torch.Generator().manual_seed(8)
    x = torch.randn(5, 64, generator=generator).to(dtype)
    norm = Gemma2RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=generator) * 0.3)
    assert torch.equal(rms_norm(x, norm.weight.detach(), 1e-6, unit_offset=True), norm(x).detach())
    gate_up = torch.randn(5, 2 * 48, generator=generator).to(dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(gelu_tanh_and_mul(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


def test_the_decode_workspace_is_reserved_for_the_block_tables_capacity():
    """A graph's grid covers max_model_len rounded up to whole blocks (1050 tokens in 128-token
    blocks: 1152), so the model runner reserves for that, not for max_model_len."""
    from types import SimpleNamespace

    from zllm.workers.model_runner import ModelRunner

    asked = {}
    runner = object.__new__(ModelRunner)
    runner.ops = SimpleNamespace(workspace=None, reserve_decode_workspace=lambda *args, **kw: asked.update(args=args))
    runner.spec = SimpleNamespace(sliding_window=None, head_dim=128)
    runner.config = SimpleNamespace(max_num_seqs=2, max_model_len=1050, mixed_graph_max_tokens=None)
    runner.num_heads, runner.num_kv_heads, runner.block_size, runner.device = 16, 2, 128, "cpu"
    runner.proposer = None
    runner._reserve_decode_workspace()
    assert asked["args"][:4] == (2, 16, 128, 1152)


def test_the_decode_workspace_covers_a_draft_models_eager_decodes(monkeypatch):
    """A draft model (or an EAGLE head) decodes through the target's ops and workspace: Llama-2-7B's
    heads (32 / 32, head_dim 128) with TinyLlama's as the draft (32 / 4, head_dim 64) ask for more
    partitions a row than the target at small batches."""
    from types import SimpleNamespace

    import torch

    from zllm.workers import kernels
    from zllm.workers.kernels import attention as attention_kernels
    from zllm.workers.model_runner import ModelRunner
    from zllm.workers.ops import CudaOps

    monkeypatch.setattr(attention_kernels, "_sm_count", lambda device: 132)
    ops = object.__new__(CudaOps)
    ops.k, ops.workspace = kernels, None
    runner = object.__new__(ModelRunner)
    runner.ops = ops
    runner.spec = SimpleNamespace(sliding_window=None, head_dim=128)
    runner.config = SimpleNamespace(max_num_seqs=8, max_model_len=1024, mixed_graph_max_tokens=None)
    runner.num_heads, runner.num_kv_heads, runner.block_size, runner.device = 32, 32, 16, torch.device("cpu")
    runner.proposer = SimpleNamespace(attention_shape=(32, 4, 64))
    runner._reserve_decode_workspace()
    for heads, kv_heads, dim in ((32, 32, 128), (32, 4, 64)):
        for rows in range(1, 9):
            for longest in range(16, 1025, 16):
                _, parts = kernels.attention_partitions(rows, heads, kv_heads, longest, None, None, 16)
                assert kernels.attention_workspace_numel(rows, heads, dim, parts) <= ops.workspace.numel()


def test_decode_workspace_covers_every_eager_step_and_the_mixed_step_graphs(monkeypatch):
    """reserve_decode_workspace: for up to max_num_seqs rows, what an eager step of any row count
    and any longest context asks (default_partitions_bound); for the larger decode graphs of
    mixed_graph_max_tokens exactly what their replays ask for."""
    import torch

    from zllm.workers import kernels
    from zllm.workers.cuda_graphs import graph_batch_sizes
    from zllm.workers.kernels import attention as attention_kernels
    from zllm.workers.ops import CudaOps

    monkeypatch.setattr(attention_kernels, "_sm_count", lambda device: 132)  # an H100's
    ops = object.__new__(CudaOps)
    ops.k = kernels
    dim = 128

    def reserved(heads, kv_heads, max_batch: int, rows: int, max_len: int) -> int:
        sizes = tuple(graph_batch_sizes(rows))
        ops.reserve_decode_workspace(max_batch, heads, dim, max_len, torch.device("cpu"), sizes, kv_heads)
        return ops.workspace.numel()

    def asked(heads, kv_heads, rows: int, max_len: int, block_size: int | None = 16) -> int:
        """What paged_attention_decode checks (block_size None: the count for any block size)."""
        _, parts = kernels.attention_partitions(rows, heads, kv_heads, max_len, torch.device("cpu"), None, block_size)
        return kernels.attention_workspace_numel(rows, heads, dim, parts)

    # Llama-3-8B's heads, and a tp 4 rank of Llama-3-70B's (tiny grids: 64-token partitions and
    # groups of 8 split in two blocks at batch 1 and 2).
    for heads, kv_heads in ((32, 8), (16, 2)):
        for max_batch, max_len in ((8, 1024), (8, 8192), (48, 4096)):
            eager = max(
                asked(heads, kv_heads, rows, longest)
                for rows in range(1, max_batch + 1)
                for longest in range(16, max_len + 1, 16)
            )
            assert eager <= reserved(heads, kv_heads, max_batch, max_batch, max_len)
    # Far less than 128-token partitions over the whole context for every row (the old reserve).
    assert reserved(32, 8, 256, 256, 131072) * 4 <= kernels.attention_workspace_numel(256, 32, dim, 131072 // 128)
    small = reserved(32, 8, 8, 512, 1024)  # few sequences, many rows: the rows' graphs decide
    assert (
        small
        == max(asked(32, 8, rows, 1024, None) for rows in graph_batch_sizes(512))
        > kernels.attention_workspace_numel(8, 32, dim, 16)
    )
