"""csrc/mla_kernels.cu against the torch references: DeepSeek's MLA decode over the latent cache
(attention.mla_decode) and GPT-OSS's decode attention with sinks and windows
(attention.decode_attention(sinks=...)), in fp32, fp16 and bf16, on caches whose unused slots
hold NaN (a slot read by mistake fails the comparison); then the tiny DeepSeek-V2 and GPT-OSS
checkpoints through the CUDA engine in fp32 (the kernels on the decode path) against HF's tokens,
eagerly and inside the decode CUDA graphs; in bf16 the graphs (MLA's latent writes and kernel,
the sinks kernel, DeepSeek's grouped routing into the fused experts, GPT-OSS's grouped-GEMM
experts) give the eager run's tokens at batch sizes 1 to 9 (graph buckets 1 to 16) and
contexts across a block, GPT-OSS's 128-token window and the MLA kernel's tiles."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import DEVICE, DTYPE_IDS, DTYPES, PagedBatch, assert_close, nan_like, randn  # noqa: E402
from tests.helpers.models import (  # noqa: E402
    hf_greedy,
    save_tiny_model,
    scale_gpt_oss_gate_up,
    write_mxfp4_experts,
    write_mxfp4_reference,
)
from tests.test_deepseek_models import _randomize_correction_bias  # noqa: E402
from zllm.workers.attention import mla_decode as mla_decode_reference  # noqa: E402
from zllm.workers.kernels import mla as mla_kernels  # noqa: E402

pytestmark = pytest.mark.gpu

LENS = [1, 7, 16, 17, 100, 257, 1030]


def _latent_batch(lens, block_size, dtype, gen, spare_blocks=3):
    """A latent cache [1, blocks, block_size, 1, 576] from a shuffled pool, NaN outside the
    sequences, with block tables that point past each sequence at a spare block."""
    dim = mla_kernels.MLA_LATENT_DIM
    blocks = [-(-n // block_size) for n in lens]
    total = sum(blocks) + spare_blocks
    pool = torch.randperm(total, generator=gen, device=DEVICE).tolist()
    table = torch.full((len(lens), max(blocks) + 2), pool[0], dtype=torch.int32)
    cache = randn(1, total, block_size, 1, dim, gen=gen, dtype=dtype)
    valid = torch.zeros(total * block_size, dtype=torch.bool, device=DEVICE)
    for i, n in enumerate(lens):
        ids = torch.tensor([pool.pop() for _ in range(blocks[i])], dtype=torch.int32)
        table[i, : len(ids)] = ids
        positions = torch.arange(n)
        valid[(ids.long()[positions // block_size] * block_size + positions % block_size).to(DEVICE)] = True
    valid = valid.view(1, total, block_size, 1, 1)
    return cache.masked_fill(~valid, float("nan")), cache * valid, table.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_heads", [1, 5, 16, 128])
def test_mla_decode_matches_reference(dtype, num_heads, gen):
    """DeepSeek's 512 + 64 latent; head counts below, at and past a block's 8, V3's 128."""
    lens = LENS if num_heads <= 16 else LENS[:4]
    cache, clean, tables = _latent_batch(lens, 16, dtype, gen)
    q = randn(len(lens), num_heads, mla_kernels.MLA_LATENT_DIM, gen=gen, dtype=dtype)
    scale = 0.1
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    expected = mla_decode_reference(
        q.double(), clean.double(), tables.long(), seq_lens.long(), lens, 16, mla_kernels.MLA_KV_LORA_RANK, scale
    )
    out = torch.full((len(lens), num_heads, 512), float("nan"), dtype=dtype, device=DEVICE)
    mla_kernels.mla_decode(out, q, cache, tables, seq_lens, scale)
    assert_close(out, expected, dtype)


def test_mla_decode_refuses_other_latents():
    q = torch.zeros(2, 4, 96, device=DEVICE)
    cache = torch.zeros(1, 4, 16, 1, 96, device=DEVICE)
    assert not mla_kernels.mla_decode_supported(q, cache, 64)
    with pytest.raises(ValueError, match="mla_decode: q_latent"):
        mla_kernels.mla_decode(
            torch.empty(2, 4, 512, device=DEVICE),
            q,
            cache,
            torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
            torch.ones(2, dtype=torch.int32, device=DEVICE),
            1.0,
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 1, 16, 128, 5000])
def test_sinks_decode_matches_reference(dtype, head_dim, window, gen):
    """GPT-OSS's shape of heads (64 query heads over 8 KV heads, scaled down), sinks of a few
    units, windows of a token, a block, GPT-OSS's 128 and longer than every context."""
    batch = PagedBatch(LENS, num_heads=8, kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype, gen=gen)
    batch.query = batch.query * 2
    sinks = randn(8, gen=gen) * 3
    expected = batch.reference(window=window, sinks=sinks)
    out = nan_like(batch.query)
    mla_kernels.paged_attention_decode_sinks(
        out, batch.query, batch.cache, batch.block_tables, batch.seq_lens_t, sinks, batch.scale, window
    )
    assert_close(out, expected, dtype)
    assert not torch.allclose(expected, batch.reference(window=window), atol=1e-2)  # the sinks matter


# ---- the tiny models through the CUDA engine -----------------------------------------------------------


def _engine_vs_hf(model_dir, prompts, max_tokens=12, enforce_eager=True, reference_dir=None, **engine_args):
    """reference_dir: the checkpoint transformers reads (default model_dir), on the CPU in fp32."""
    from transformers import AutoModelForCausalLM

    from zllm import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(
        reference_dir or model_dir, dtype=torch.float32, experts_implementation="eager"
    )
    hf = hf.eval()
    expected = [hf_greedy(hf, p, max_tokens, eos_token_id=None) for p in prompts]
    del hf
    llm = LLM(
        str(model_dir),
        device="cuda",
        dtype="float32",
        gpu_memory_utilization=0.3,
        enforce_eager=enforce_eager,
        max_num_seqs=8,  # graphs for batches 1 to 8: quick to capture
        **engine_args,
    )
    try:
        # The decode graphs hold the model unless eager was asked for (MLA and sinks included).
        assert (llm.engine.core.executor.runner.graphs is not None) == (not enforce_eager)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected


PROMPTS = [[7, 3, 9, 11, 5], list(range(3, 40)), list(range(200, 213))]


DEEPSEEK_V2 = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    topk_method="group_limited_greedy",
    n_group=4,
    topk_group=2,
    initializer_range=0.2,
)

GPT_OSS = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    initializer_range=0.2,
    # Every setting that transformers versions treat differently, explicit and as gpt-oss ships
    # them: 5.17's experts ignore swiglu_limit and swiglu_alpha (their 7.0 and 1.702 hard-coded;
    # later versions read the config), so a test-only limit (1.0 once) makes 5.17's reference a
    # different model. GPT_OSS_GATE_UP_SCALE makes the real limit clamp instead. The rotary is
    # gpt-oss's YaRN, written out rather than left to a version's default.
    swiglu_limit=7.0,
    swiglu_alpha=1.702,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)
GPT_OSS_GATE_UP_SCALE = 4.0  # 14% of the tiny model's gate values, 27% of its up values pass 7


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_deepseek_v2_on_cuda_matches_hf(tmp_path, eager):
    """DeepSeek's real latent (512 + 64): the decodes go through mla_decode's kernel. fp32 MoE
    layers run the torch expert loop, which no graph holds, so the graphed run's model has dense
    layers only (first_k_dense_replace = its 2 layers): the graphs hold MLA whole."""
    config = DEEPSEEK_V2 if eager else {**DEEPSEEK_V2, "first_k_dense_replace": 2}
    model_dir = save_tiny_model(tmp_path / "dsv2", "deepseek_v2", **config)
    _engine_vs_hf(model_dir, PROMPTS, enforce_eager=eager)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_gpt_oss_on_cuda_matches_hf(tmp_path, eager):
    """head_dim 64 with sinks and an 8-token window: the decodes go through the sinks kernel;
    MXFP4 experts dequantized on the GPU; in fp32 the experts run every expert on every token
    (ops.gpt_oss_experts: graph-safe), inside the graphs too. The clamped SwiGLU at gpt-oss's own
    limit (GPT_OSS: the one limit every transformers version applies)."""
    model_dir = scale_gpt_oss_gate_up(save_tiny_model(tmp_path / "oss", "gpt_oss", **GPT_OSS), GPT_OSS_GATE_UP_SCALE)
    # transformers 5.17 (the GPU machines') dequantizes MXFP4 experts to bfloat16 whatever dtype
    # is asked: the reference reads the same kept values stored plain in fp32.
    reference = write_mxfp4_reference(model_dir, tmp_path / "oss-reference")
    _engine_vs_hf(write_mxfp4_experts(model_dir), PROMPTS, enforce_eager=eager, reference_dir=reference)


# ---- bf16: the decode graphs against the eager run -------------------------------------------------

# Contexts within a block, across blocks, across GPT-OSS's 128-token window and far past it.
GRAPH_PROMPT_LENS = [5, 17, 100, 127, 200, 301, 9, 64, 150]


def _bf16_tokens(model_dir, prompts, max_tokens, **engine_args):
    """Greedy bf16 tokens with staggered arrivals (the decode batch grows step by step, through
    several graph buckets), and whether the decode graphs were captured."""
    from zllm import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(
        str(model_dir),
        device="cuda",
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=16,  # graph buckets 1, 2, 4, 8, 16
        gpu_memory_utilization=0.3,
        **engine_args,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
            if i % 2:
                engine.step()
        results = {}
        while engine.has_unfinished_requests():
            results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return [results[str(i)] for i in range(len(prompts))], engine.core.executor.runner.graphs is not None
    finally:
        engine.shutdown()


def _graph_prompts(count):
    import random

    rng = random.Random(count)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in GRAPH_PROMPT_LENS[:count]]


@pytest.mark.parametrize("count", [2, 9])
@pytest.mark.parametrize("model", ["deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_bf16_graphs_equal_eager(tmp_path, model, count):
    """2 and 9 requests, 40 tokens each, arriving a step apart and so finishing a step apart: the
    decode batch walks 1 to 9 rows (graph buckets 1, 2, 4, 8 and 16, padded rows writing
    nowhere), contexts from 5 to 340 tokens. The graphed decodes give the eager run's tokens
    exactly (the same kernels, replayed)."""
    if model == "gpt_oss":
        model_dir = write_mxfp4_experts(
            save_tiny_model(
                tmp_path / model, model, **{**GPT_OSS, "sliding_window": 128, "max_position_embeddings": 512}
            )
        )
    else:
        config = {**DEEPSEEK_V2, "max_position_embeddings": 512}
        if model == "deepseek_v3":  # noaux_tc: sigmoid routing with a correction bias; a q LoRA
            del config["topk_method"]
            config |= dict(q_lora_rank=48, norm_topk_prob=True, routed_scaling_factor=2.5)
        model_dir = save_tiny_model(tmp_path / model, model, **config)
        if model == "deepseek_v3":
            _randomize_correction_bias(model_dir)
    prompts = _graph_prompts(count)
    # Steps with prefill stay eager (mixed_graph_max_tokens=0): as decode rows they would take the
    # decode kernels, which round otherwise than the eager prefill (CPU: rows = HF in fp32).
    graphs, graphed = _bf16_tokens(model_dir, prompts, 40, mixed_graph_max_tokens=0)
    eager, _ = _bf16_tokens(model_dir, prompts, 40, enforce_eager=True)
    assert graphed
    assert graphs == eager
