"""The host side of the decode graphs for DeepSeek (MLA) and GPT-OSS (sinks, its experts), on CPU:

- a decode graph's metadata carries no host lengths (seq_lens_list empty): the reference decode
  attentions (attention.decode_attention with sinks and windows, attention.mla_decode) then read
  the block tables' whole width, masked by the device's seq_lens, and give what an eager step,
  which sizes its reads by the host lengths, gives;
- GPT-OSS's graph-safe expert paths (grouped GEMMs, every expert) give HF's expert loop's output;
- which models the runner captures decode graphs for.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, GptOssConfig

from zllm.model_spec import ModelSpec
from zllm.workers import attention as ref
from zllm.workers.attention import AttentionMetadata
from zllm.workers.distributed import TensorParallel
from zllm.workers.model_runner import moe_graph_safe
from zllm.workers.models.gpt_oss import GptOssExperts
from zllm.workers.ops import CudaOps, TorchOps

BLOCK = 4
TABLE_WIDTH = 12  # blocks per sequence a graph's tables hold: 48 tokens
LENS = [1, 5, 8, 9, 30]  # within a block, at and past its end, many blocks


def _paged(gen: torch.Generator, lens: list[int], latent_dim: int | None = None):
    """A shuffled cache whose unused slots hold values a hundred times larger (a key the mask
    lets through by mistake would dominate the softmax), block tables of TABLE_WIDTH columns."""
    num_blocks = len(lens) * TABLE_WIDTH + 1
    shape = (1, num_blocks, BLOCK, 1, latent_dim) if latent_dim else (2, num_blocks, BLOCK, 2, 16)
    cache = torch.randn(*shape, generator=gen)
    order = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * TABLE_WIDTH] + 1
    tables = order.view(len(lens), TABLE_WIDTH).to(torch.int32)
    used = torch.zeros(num_blocks, BLOCK, dtype=torch.bool)
    for row, n in enumerate(lens):
        for t in range(n):
            used[tables[row, t // BLOCK], t % BLOCK] = True
    cache = torch.where(used[None, :, :, None, None], cache, 100 * torch.randn(cache.shape, generator=gen))
    meta = AttentionMetadata(
        slot_mapping=torch.full((len(lens),), -1, dtype=torch.long),
        block_tables=tables,
        seq_lens=torch.tensor(lens),
        seq_lens_list=list(lens),
        query_start_loc=list(range(len(lens) + 1)),
        num_decodes=len(lens),
        block_size=BLOCK,
    )
    return cache, meta


def test_decode_blocks_graph_metadata_reads_the_whole_table():
    assert ref.decode_blocks([], TABLE_WIDTH, BLOCK) == (0, TABLE_WIDTH)
    assert ref.decode_blocks([], TABLE_WIDTH, BLOCK, window=3) == (0, TABLE_WIDTH)
    assert ref.decode_blocks([5, 9], TABLE_WIDTH, BLOCK) == (0, 3)  # the longest, 9 tokens: 3 blocks
    assert ref.decode_blocks([30, 29], TABLE_WIDTH, BLOCK, window=8) == (5, 8)  # keys from 22 on


@pytest.mark.parametrize("window", [None, 3, 8])
def test_sinks_decode_reference_without_host_lengths(window):
    gen = torch.Generator().manual_seed(0)
    cache, meta = _paged(gen, LENS)
    query = torch.randn(len(LENS), 4, 16, generator=gen)
    sinks = torch.randn(4, generator=gen) * 2
    eager = ref.decode_attention(query, cache, meta, 0.25, window=window, sinks=sinks)
    graph = ref.decode_attention(
        query, cache, dataclasses.replace(meta, seq_lens_list=[]), 0.25, window=window, sinks=sinks
    )
    torch.testing.assert_close(graph, eager, rtol=1e-6, atol=1e-6)


def test_mla_decode_reference_without_host_lengths():
    gen = torch.Generator().manual_seed(1)
    rank, rope = 24, 8
    cache, meta = _paged(gen, LENS, latent_dim=rank + rope)
    q = torch.randn(len(LENS), 3, rank + rope, generator=gen)
    args = (meta.block_tables, meta.seq_lens, BLOCK, rank, 0.3)
    eager = ref.mla_decode(q, cache, args[0], args[1], meta.seq_lens_list, *args[2:])
    graph = ref.mla_decode(q, cache, args[0], args[1], [], *args[2:])
    torch.testing.assert_close(graph, eager, rtol=1e-6, atol=1e-6)


def test_write_latent_skips_padded_rows():
    cache = torch.zeros(1, 3, BLOCK, 1, 6)
    latent = torch.arange(18, dtype=torch.float32).view(3, 6) + 1
    TorchOps().write_latent(cache, latent, torch.tensor([5, -1, 0]))
    rows = cache.view(-1, 6)
    assert torch.equal(rows[5], latent[0]) and torch.equal(rows[0], latent[2])
    assert int((rows != 0).any(dim=1).sum()) == 2  # the padded row went nowhere


def _gpt_oss_spec(**overrides) -> ModelSpec:
    config = GptOssConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        swiglu_limit=1.0,
        **overrides,
    )
    return ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gpt_oss_graph_safe_experts_equal_the_loop(tokens):
    """Grouped GEMMs and every-expert: HF's loop's output (fp32), with experts some token skips,
    the clamp reached (limit 1), biases on both projections."""
    gen = torch.Generator().manual_seed(tokens)
    experts = GptOssExperts(_gpt_oss_spec(), TensorParallel(rank=0, size=1))
    for param in experts.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.5
    experts.finish_loading()
    x = torch.randn(tokens, 32, generator=gen)
    logits = torch.randn(tokens, 6, generator=gen)
    top, ids = torch.topk(logits, 2, dim=-1)
    weights = torch.softmax(top, dim=1)
    expected = experts(x, weights, ids)
    torch.testing.assert_close(experts.forward_grouped(x, weights, ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(experts.forward_dense(x, weights, ids), expected, rtol=1e-5, atol=1e-5)


def test_which_moe_models_decode_graphs_hold():
    gpt_oss = _gpt_oss_spec()
    deepseek = ModelSpec.from_hf_config(
        DeepseekV3Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
        )
    )
    all_dense = dataclasses.replace(deepseek, moe=dataclasses.replace(deepseek.moe, layers=()))
    cuda = CudaOps(torch.device("cpu"))
    assert moe_graph_safe(all_dense, cuda, torch.float32)  # first_k_dense_replace = every layer
    # GPT-OSS's experts are graph-safe in every dtype on CUDA; DeepSeek's through the fused kernels.
    assert moe_graph_safe(gpt_oss, cuda, torch.float32) and moe_graph_safe(gpt_oss, cuda, torch.bfloat16)
    assert moe_graph_safe(deepseek, cuda, torch.bfloat16) and not moe_graph_safe(deepseek, cuda, torch.float32)
    assert not moe_graph_safe(gpt_oss, TorchOps(), torch.float32)


# ---- a decode graph's forward, run eagerly on CPU ----------------------------------------------

GRAPH_BLOCK = 8
GRAPH_WIDTH = 4  # blocks per sequence
GRAPH_LENS = [5, 9, 20]  # contexts across blocks and past GPT-OSS's 8-token window


def _tiny_model(tmp_path, kind: str):
    from tests.helpers.models import save_tiny_model, write_mxfp4_experts
    from tests.test_deepseek_models import CASES, COMMON, _randomize_correction_bias
    from tests.test_gpt_oss_model import CONFIG

    if kind == "gpt_oss":
        return write_mxfp4_experts(save_tiny_model(tmp_path / kind, "gpt_oss", **CONFIG))
    architecture, overrides = CASES["v3"]
    model_dir = save_tiny_model(tmp_path / kind, architecture, **{**COMMON, **overrides})
    _randomize_correction_bias(model_dir)
    return model_dir


def _step_meta(tables: torch.Tensor, starts: list[int], counts: list[int], hybrid: bool) -> AttentionMetadata:
    """Each sequence's tokens [start, start + count) as one step (prefill or decode)."""
    positions = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)])
    rows = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])
    slots = tables[rows, positions // GRAPH_BLOCK].long() * GRAPH_BLOCK + positions % GRAPH_BLOCK
    lens = [s + c for s, c in zip(starts, counts)]
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.tensor(lens),
        seq_lens_list=lens,
        query_start_loc=[0, *torch.tensor(counts).cumsum(0).tolist()],
        num_decodes=len(counts) if all(c == 1 for c in counts) else 0,
        block_size=GRAPH_BLOCK,
    )
    if hybrid:  # the sliding layers' tables: the same blocks here
        meta.sliding = dataclasses.replace(meta)
    return meta, positions


@pytest.mark.parametrize("kind", ["deepseek_v3", "gpt_oss"])
def test_decode_graph_forward_equals_the_eager_step(tmp_path, kind):
    """DecodeGraphs' own buffers and metadata (no host lengths, the batch padded from 3 to 4
    rows with slot -1), its forward run eagerly: the eager step's hidden states, and the cache
    as the eager step left it (the padded row wrote nowhere). (The CUDA kernels' side of the
    same is tests/gpu/test_mla_sinks_gpu.py.) MLA's latent write and reference
    decode, the sinks' reference decode with windows, GPT-OSS's experts, all on the graph's
    metadata."""
    from zllm.config import EngineConfig
    from zllm.workers.cuda_graphs import DecodeGraphs
    from zllm.workers.model_runner import ModelRunner

    config = EngineConfig.create(
        str(_tiny_model(tmp_path, kind)), dtype="float32", device="cpu", block_size=GRAPH_BLOCK
    )
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(1 + len(GRAPH_LENS) * GRAPH_WIDTH, split=False)
    model, caches = runner.model, runner.kv_caches
    gen = torch.Generator().manual_seed(3)
    tables = (torch.randperm(len(GRAPH_LENS) * GRAPH_WIDTH, generator=gen) + 1).view(len(GRAPH_LENS), GRAPH_WIDTH)
    with torch.inference_mode():
        prefill, positions = _step_meta(tables, [0] * len(GRAPH_LENS), GRAPH_LENS, runner.hybrid)
        model(torch.randint(3, 200, (len(positions),), generator=gen), positions, caches, prefill)
        decode, positions = _step_meta(tables, GRAPH_LENS, [1] * len(GRAPH_LENS), runner.hybrid)
        input_ids = torch.randint(3, 200, (len(GRAPH_LENS),), generator=gen)
        eager = model(input_ids, positions, caches, decode)
        after_eager = [c.clone() for c in caches]

        graphs = DecodeGraphs(model, caches, 4, GRAPH_WIDTH, GRAPH_BLOCK, runner.hybrid)
        size = graphs.load(
            input_ids, positions, decode.slot_mapping, tables.to(torch.int32), decode.seq_lens, decode.sliding
        )
        assert size == 4
        graphed = graphs._forward(size, graphs._meta(size))[: len(GRAPH_LENS)]
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    for cache, expected in zip(caches, after_eager):
        # The real rows rewrote their slots (values from hidden states equal to rounding); the
        # padded row, whose table points at block 0, wrote nowhere: block 0 stays zero.
        torch.testing.assert_close(cache, expected, rtol=1e-5, atol=1e-5)
        assert not cache[:, 0].any()
