"""Block-FP8 MoE/MLA checkpoints kept in FP8 on CUDA (ZLLM_FP8_BLOCKS auto = keep there): a
tiny DeepSeek-V3 FP8 checkpoint (tests/helpers/models.py's TINY_V3_FP8, written as DeepSeek's
release is) against the same checkpoint dequantized at load (ZLLM_FP8_BLOCKS=dequantize,
the CPU's default and the reference): fewer weight bytes, the same fp32 greedy tokens (the
products run on the dequantized values: the emulated weight-only GEMM, the torch expert loop),
and in bf16 with decode graphs close tokens (the FP8 GEMV and the fused experts over the chosen
experts' dequantized copies instead of the bf16 GEMV and the experts' GEMVs). Then the FP8
experts through the fused kernels against the dequantized experts through the same kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.models import save_tiny_v3_fp8  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPTS = [[7, 3, 9, 11, 5], list(range(3, 40)), [7] * 5 + list(range(100, 130)), list(range(200, 213))]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def v3_fp8_dir(tmp_path_factory):
    return save_tiny_v3_fp8(tmp_path_factory.mktemp("v3fp8") / "m")


def _run(model_dir, monkeypatch, mode: str, dtype: str) -> tuple[list[list[int]], int, bool]:
    """Greedy tokens, the model's parameter bytes and whether decode graphs were captured."""
    from zllm import LLM, SamplingParams

    monkeypatch.setenv("ZLLM_FP8_BLOCKS", mode)
    llm = LLM(str(model_dir), device="cuda", dtype=dtype, gpu_memory_utilization=0.3, max_num_seqs=8, max_model_len=128)
    try:
        runner = llm.engine.core.executor.runner
        param_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
        return [o.outputs[0].token_ids for o in outs], param_bytes, runner.graphs is not None
    finally:
        llm.shutdown()


def test_kept_fp8_equals_the_dequantized_model_in_fp32(v3_fp8_dir, monkeypatch):
    kept, kept_bytes, _ = _run(v3_fp8_dir, monkeypatch, "auto", "float32")
    dequantized, dequantized_bytes, _ = _run(v3_fp8_dir, monkeypatch, "dequantize", "float32")
    assert kept == dequantized
    # FP8 weights are a quarter of fp32 ones; embeddings, head, norms and routers stay fp32.
    assert kept_bytes < 0.5 * dequantized_bytes, (kept_bytes, dequantized_bytes)


def test_kept_fp8_is_close_to_the_dequantized_model_in_bf16_with_graphs(v3_fp8_dir, monkeypatch):
    kept, kept_bytes, kept_graphs = _run(v3_fp8_dir, monkeypatch, "auto", "bfloat16")
    dequantized, dequantized_bytes, graphs = _run(v3_fp8_dir, monkeypatch, "dequantize", "bfloat16")
    assert kept_graphs and graphs  # the FP8 experts are graph-safe (no host sync)
    assert kept_bytes < 0.7 * dequantized_bytes, (kept_bytes, dequantized_bytes)
    same = sum(a == b for k, d in zip(kept, dequantized) for a, b in zip(k, d))
    assert same >= 0.75 * len(PROMPTS) * MAX_TOKENS, (kept, dequantized)
    # The prefills' tokens: the same dequantized values through the same GEMMs (ops.linear).
    assert all(k[0] == d[0] for k, d in zip(kept, dequantized))


@pytest.mark.parametrize("tokens", [1, 3, 64])  # gathered chosen experts (decode) and every expert
def test_fp8_experts_through_the_fused_kernels(tokens):
    from zllm.partition import Span
    from zllm.workers.fp8 import dequantize, quantize_blocks
    from zllm.workers.kernels import moe as fused
    from zllm.workers.models.moe import Fp8Experts
    from zllm.workers.ops import CudaOps

    torch.manual_seed(0)
    num_experts, hidden, inter = 16, 512, 256
    # Built under the model's dtype, as the model builds them: it is the experts' compute dtype.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        experts = Fp8Experts(num_experts, hidden, inter, Span(0, inter), serialized=False).cuda()
    finally:
        torch.set_default_dtype(previous)
    assert experts.compute_dtype == torch.bfloat16
    dense_gate_up, dense_down = [], []
    for e in range(num_experts):
        gate, up, down = (
            torch.randn(shape, device="cuda") * 0.05 for shape in ((inter, hidden),) * 2 + ((hidden, inter),)
        )
        for shard, values in ((2 * e, gate), (2 * e + 1, up)):
            experts.load_target("gate_up_proj", shard).fill(values)
        experts.load_target("down_proj", e).fill(down)
        dense_gate_up.append(torch.cat([dequantize(*quantize_blocks(w), block=True) for w in (gate, up)]))
        dense_down.append(dequantize(*quantize_blocks(down), block=True))
    gate_up = torch.stack(dense_gate_up).bfloat16().contiguous()
    down = torch.stack(dense_down).bfloat16().contiguous()
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(num_experts, device="cuda")[:4] for _ in range(tokens)])
    weights = torch.rand(tokens, 4, device="cuda")
    ops = CudaOps(torch.device("cuda"))
    assert ops.fuses_experts(experts, 4)
    out = ops.moe_experts(x, weights, ids, experts)
    expected = fused.experts(x, weights, ids.to(torch.int32), gate_up, down)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())
