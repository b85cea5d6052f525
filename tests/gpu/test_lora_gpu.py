"""LoRA on the GPU: csrc/lora_kernels.cu's shrink and expand, and zllm/workers/lora.py's dense
path (GEMMs over every slot), against a float64 oracle on the same rounded inputs for rows of
mixed slots, base rows and padding (1, 7, 33 and 300 rows; input widths of one shrink block's
step, of Llama-3-8B's hidden size and of its down projection); and the engine (CUDA graphs on)
against transformers + PEFT on a tiny Llama with four adapters in one batch: kernels only, dense
only, the default split between them, and the torch path (ZLLM_LORA_KERNELS=0).

The expand fused into the GEMV (csrc/gemv_kernels.cu gemv_lora_*, gemv_rows_lora_*) for 1 and
2-8 rows over Llama-3-8B's projection shapes and every build, against the float64 oracle and
ops.linear_lora_reference (rows of slot -1: the plain GEMV's bits, whatever t holds); in a CUDA
graph with the slots changed between replays; and the engine at batch 1 and 5 (the decode steps
the fused kernels take) with the fusion on and off, against PEFT."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import DTYPE_IDS, DTYPES, assert_close, nan_like, randn  # noqa: E402
from tests.helpers.lora import MAX_NEW, PROMPTS, SPECS, tiny_llama_with_adapters  # noqa: E402
from zllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from zllm.workers import kernels, ops  # noqa: E402
from zllm.workers.kernels.lora import lora_expand, lora_shrink  # noqa: E402
from zllm.workers.kernels.matvec import LoRAEpilogue  # noqa: E402
from zllm.workers.lora import LoRABatch, dense_add  # noqa: E402

pytestmark = pytest.mark.gpu


def reference(x, a, b, slots, part_ends, rank, out):
    """out + (x A^T)_p B_p^T per row's slot (the scale is folded into A), in float64; b [out, S, R]."""
    expected = out.double().clone()
    starts = [0, *part_ends[:-1]]
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        t = x[row].double() @ a[slot].double().T
        for p, (start, end) in enumerate(zip(starts, part_ends)):
            expected[row, start:end] += t[p * rank : (p + 1) * rank] @ b[start:end, slot].double().T
    return expected


def case(dtype, parts, tokens, in_features, gen, slots=4, rank=16):
    """Random slots (A times a per-part scale, B [out, S, R]), rows of slots -1..S-1, x and out."""
    scale = torch.rand(slots, len(parts), 1, 1, generator=gen, device="cuda") * 2
    a = randn(slots, len(parts), rank, in_features, gen=gen) * (1.6 / in_features**0.5) * scale
    a = a.view(slots, len(parts) * rank, in_features).to(dtype)
    b = randn(parts[-1], slots, rank, gen=gen, dtype=dtype) * 0.1
    x = randn(tokens, in_features, gen=gen, dtype=dtype)
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen, device="cuda", dtype=torch.int32)
    out = randn(tokens, parts[-1], gen=gen, dtype=dtype)
    return a, b, x, token_slots, out


TOKENS = [1, 7, 33, 300]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("parts", [[96], [64, 96, 128], [80, 160]], ids=["one", "qkv", "gate_up"])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("in_features", [256, 4096])
def test_shrink_expand_match_the_reference(dtype, parts, tokens, in_features, gen):
    rank = 16
    a, b, x, token_slots, out = case(dtype, parts, tokens, in_features, gen)
    expected = reference(x, a, b, token_slots, parts, rank, out)
    t = nan_like(torch.empty(tokens, len(parts) * rank, device="cuda"))
    lora_shrink(t, x, a, token_slots)
    lora_expand(out, t, b, token_slots, parts)
    assert_close(out, expected, dtype, scale=2.0)


@pytest.mark.parametrize("tokens", [1, 33])
def test_kernels_at_the_down_projection_width(tokens, gen):
    """Llama-3-8B's down projection (in 14336, out 4096), 8 slots, rank 16, bf16: a shrink thread
    walks 7 steps of the input, and x's rows are a strided view (stride of a wider buffer)."""
    dtype, rank, parts = torch.bfloat16, 16, [4096]
    a, b, _, token_slots, out = case(dtype, parts, tokens, 14336, gen, slots=8)
    x = randn(tokens, 14336 + 64, gen=gen, dtype=dtype)[:, :14336]
    expected = reference(x, a, b, token_slots, parts, rank, out)
    t = nan_like(torch.empty(tokens, rank, device="cuda"))
    lora_shrink(t, x, a, token_slots)
    lora_expand(out, t, b, token_slots, parts)
    assert_close(out, expected, dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("parts", [[96], [64, 96, 128], [80, 160]], ids=["one", "qkv", "gate_up"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_dense_path_matches_the_reference(dtype, parts, tokens, gen):
    """cuBLAS over every slot, masked per row (t rounded to the dtype, where the kernels keep fp32)."""
    rank = 16
    a, b, x, token_slots, out = case(dtype, parts, tokens, 4096, gen)
    expected = reference(x, a, b, token_slots, parts, rank, out)
    mask = nan_like(torch.empty(tokens, a.shape[0], device="cuda", dtype=dtype))
    batch = LoRABatch(token_slots=token_slots, slot_mask=mask)
    batch.fill_slot_mask()  # as LoRAManager does each step
    part_rows = [(start, end - start) for start, end in zip([0, *parts[:-1]], parts)]
    dense_add(out, x, a, b, batch.slot_mask, part_rows)
    assert_close(out, expected, dtype, scale=2.0)


def test_rows_of_the_base_model_are_left_untouched(gen):
    a = randn(2, 16, 64, gen=gen)
    b = randn(32, 2, 16, gen=gen)  # [out, S, R]
    out = randn(5, 32, gen=gen)
    before = out.clone()
    t = torch.empty(5, 16, device="cuda")
    slots = torch.full((5,), -1, dtype=torch.int32, device="cuda")
    lora_expand(out, lora_shrink(t, randn(5, 64, gen=gen), a, slots), b, slots, [32])
    assert torch.equal(out, before) and torch.equal(t, torch.zeros_like(t))


# ---- the expand in the GEMV's epilogue --------------------------------------------------------------------

# Llama-3-8B's projections: (in, part ends).
LLAMA3_8B = {
    "qkv": (4096, [4096, 5120, 6144]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 28672]),
    "down": (14336, [4096]),
}
# Each row's slot: an adapter in slot 0 or 3 of 4, or the base model (-1), mixed for 2-8 rows.
ROW_SLOTS = {"1-slot-1": [-1], "1-slot0": [0], "1-slot3": [3], "3": [0, -1, 3], "8": [3, 0, -1, 0, 3, -1, 3, 0]}


def fused_case(dtype, in_features, ends, slots, gen, with_bias=False):
    """x, the base weight (rows scaled by 1/sqrt(in): O(1) outputs), bias, 4 slots of rank 16 and
    the shrink's t for each row's slot (NaN in rows of slot -1: the kernel must not read them)."""
    rank, parts = 16, len(ends)
    x = randn(len(slots), in_features, gen=gen, dtype=dtype)
    weight = (randn(ends[-1], in_features, gen=gen) / math.sqrt(in_features)).to(dtype)
    bias = randn(ends[-1], gen=gen, dtype=dtype) if with_bias else None
    a = (randn(4, parts * rank, in_features, gen=gen) / math.sqrt(in_features)).to(dtype)
    b = (randn(ends[-1], 4, rank, gen=gen) * 0.25).to(dtype)
    token_slots = torch.tensor(slots, dtype=torch.int32, device="cuda")
    t = lora_shrink(torch.empty(len(slots), parts * rank, device="cuda"), x, a, token_slots)
    t[token_slots < 0] = float("nan")
    return x, weight, bias, LoRAEpilogue(t, b, token_slots, ends)


def fused_oracle(x, weight, bias, lora):
    """float64: x W^T + bias + B[n, slot] . t[part(n)] for rows of a slot."""
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    starts = [0, *lora.part_ends[:-1]]
    rank = lora.b.shape[2]
    for row, slot in enumerate(lora.token_slots.tolist()):
        if slot >= 0:
            for p, (start, end) in enumerate(zip(starts, lora.part_ends)):
                t = lora.t[row, p * rank : (p + 1) * rank].double()
                expected[row, start:end] += lora.b[start:end, slot].double() @ t
    return expected


def run_fused(x, weight, bias, lora, variant=None):
    """The fused kernel and the plain one (same build) into NaN buffers."""
    rows, n = x.shape[0], weight.shape[0]
    fused, plain = (torch.full((rows, n), float("nan"), dtype=x.dtype, device="cuda") for _ in range(2))
    kernel = kernels.gemv if rows == 1 else kernels.gemv_rows
    kernel(fused, x, weight, bias, variant=variant, lora=lora)
    kernel(plain, x, weight, bias, variant=variant)
    return fused, plain


def check_fused(x, weight, bias, lora, dtype, variant=None):
    fused, plain = run_fused(x, weight, bias, lora, variant)
    # The expand adds O(1): the dtype's tolerance, doubled for its rounding.
    assert_close(fused, fused_oracle(x, weight, bias, lora), dtype, scale=2.0)
    assert_close(fused, ops.linear_lora_reference(x, weight, bias, lora), dtype, scale=2.0)
    base = (lora.token_slots < 0).nonzero().flatten()
    assert torch.equal(fused[base], plain[base]), "rows of slot -1 must be the plain GEMV's, bit for bit"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("shape", list(LLAMA3_8B))
@pytest.mark.parametrize("slots", list(ROW_SLOTS.values()), ids=list(ROW_SLOTS))
def test_fused_gemv_matches_the_reference(dtype, shape, slots, gen):
    """The default builds (the engine's) over Llama-3-8B's projection shapes: 1 row (gemv_lora,
    split b6) and 3 or 8 rows (gemv_rows_lora, tensor cores)."""
    in_features, ends = LLAMA3_8B[shape]
    check_fused(*fused_case(dtype, in_features, ends, slots, gen), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("variant", ["", "b0", "b4", "b6", "s1_b4", "s2_b6", "s4_b6"], ids=lambda v: v or "warp")
def test_fused_gemv_builds(dtype, variant, gen):
    """Every one-row build with a bias, an odd N (a block's rows past it) and K with a masked last
    round; rank 16 (two 16-byte pieces of B a row for fp16/bf16, four for fp32)."""
    for slots in ([0], [3], [-1]):
        case = fused_case(dtype, 4104, [40, 77, 101], slots, gen, with_bias=True)
        check_fused(*case, dtype, variant=variant)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "variant", [f"mma_g{g}_s{s}" for g in (1, 2) for s in (1, 2, 4)] + [f"fma_s{s}" for s in (1, 2, 4)]
)
def test_fused_gemv_rows_builds(dtype, variant, gen):
    """Every 2-8-row build (mma: fp16/bf16) at 2, 5 and 8 rows, as test_fused_gemv_builds."""
    if dtype == torch.float32 and variant.startswith("mma"):
        pytest.skip("tensor cores: fp16 and bf16 only")
    for slots in ([0, -1], [3, 0, -1, 3, 1], ROW_SLOTS["8"]):
        case = fused_case(dtype, 4104, [40, 77, 101], slots, gen, with_bias=True)
        check_fused(*case, dtype, variant=variant)


def test_fused_gemv_rejects(gen):
    x, weight, bias, lora = fused_case(torch.bfloat16, 256, [64], [0], gen)
    out = torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")
    for bad, match in [
        (lora._replace(part_ends=[32]), "part_ends"),
        (lora._replace(t=lora.t[:, :8].contiguous()), "t "),
        (lora._replace(b=lora.b[:, :, :12].contiguous()), "b "),  # rank 12: not whole 16-byte pieces
        (lora._replace(token_slots=lora.token_slots.long()), "token_slots"),
        (lora._replace(t=lora.t.to(torch.bfloat16)), "t has dtype"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernels.gemv(out, x, weight, bias, lora=bad)


def test_fused_projection_in_a_cuda_graph(gen):
    """LoRALayer.project on a qkv-shaped projection (shrink + fused GEMV) captured once and replayed
    with the row's slot changed on the device (0, 3, -1) and new inputs: each replay equals the
    eager call bit for bit and, to rounding, the unfused kernels (shrink + GEMV + expand)."""
    from zllm.partition import Span
    from zllm.workers.linear_weights import FusedPart
    from zllm.workers.lora import LoRABatch, LoRALayer
    from zllm.workers.parallel_layers import ColumnParallelLinear

    kernels.preload()
    dtype, in_features, parts = torch.bfloat16, 4096, [4096, 1024, 1024]
    with torch.device("cuda"):
        linear = ColumnParallelLinear(in_features, [FusedPart(n, Span(0, n)) for n in parts], bias=False)
    linear.to(dtype)
    with torch.no_grad():
        linear.weight.copy_(randn(*linear.weight.shape, gen=gen) / 64)
    batch = LoRABatch(token_slots=torch.full((8,), -1, dtype=torch.int32, device="cuda"), dense_from=32)
    batch.fused_expand = True
    layer = linear.lora = LoRALayer(linear, 4, 16, batch)
    with torch.no_grad():
        layer.A.copy_(randn(*layer.A.shape, gen=gen) / 64)
        layer.B.copy_(randn(*layer.B.shape, gen=gen) / 4)
    x = randn(1, in_features, gen=gen, dtype=dtype)
    assert layer.fuses(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up
        linear(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = linear(x)
    for slot in (0, 3, -1):
        batch.token_slots[0] = slot
        x.copy_(randn(1, in_features, gen=gen, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, linear(x))
        batch.fused_expand = False
        unfused = linear(x)
        batch.fused_expand = True
        assert_close(out, unfused, dtype, scale=2.0)
        if slot < 0:
            assert torch.equal(out, ops.linear(x, linear.weight))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_dim 64: the smallest the CUDA attention kernels take (the CPU tests' tiny Llama has 16).
    return tiny_llama_with_adapters(tmp_path_factory.mktemp("lora-gpu"), head_dim=64)


def _mixed(llm: LLM, adapters) -> tuple[list, list[list[int]]]:
    loras = {name: LoRARequest(name, i + 1, str(adapters / name)) for i, name in enumerate(SPECS)}
    pairs = [(name, ids) for ids in PROMPTS for name in ["base", *SPECS]]
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for _, ids in pairs],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        use_tqdm=False,
        lora_request=[loras.get(name) for name, _ in pairs],
    )
    return pairs, [o.outputs[0].token_ids for o in outputs]


# (ZLLM_LORA_KERNELS, ZLLM_LORA_DENSE_ROWS_PER_SLOT): kernels only, dense only, the default split.
PATHS = {"kernels": ("1", "inf"), "dense": ("1", "0"), "split": ("1", ""), "torch": ("0", "")}


@pytest.mark.parametrize("path", list(PATHS))
def test_engine_mixed_batch_matches_peft(tiny, path, monkeypatch):
    """fp32 on the GPU, CUDA graphs on with the kernels and the dense path: every (adapter,
    prompt) equals transformers + PEFT's greedy tokens."""
    kernels, dense_rows = PATHS[path]
    monkeypatch.setenv("ZLLM_LORA_KERNELS", kernels)
    monkeypatch.setenv("ZLLM_LORA_DENSE_ROWS_PER_SLOT", dense_rows)
    model_dir, adapters, references = tiny
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=4, gpu_memory_utilization=0.3) as llm:
        pairs, tokens = _mixed(llm, adapters)
    expected = [references[name][PROMPTS.index(ids)] for name, ids in pairs]
    assert tokens == expected


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "unfused"])
def test_engine_small_batches_match_peft(tiny, fused, monkeypatch):
    """Decode steps the fused GEMV takes (fp32, CUDA graphs on): each (adapter, prompt) alone
    (1 row) and the base model with the four adapters on one prompt (5 rows: gemv_rows), with
    the fusion on and off (ZLLM_LORA_FUSED_EXPAND): every output equals transformers + PEFT."""
    monkeypatch.setenv("ZLLM_LORA_FUSED_EXPAND", fused)
    model_dir, adapters, references = tiny
    loras = {name: LoRARequest(name, i + 1, str(adapters / name)) for i, name in enumerate(SPECS)}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    names = ["base", *SPECS]
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=4, gpu_memory_utilization=0.3) as llm:
        for name in names:
            for index, ids in enumerate(PROMPTS):
                [output] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False, lora_request=loras.get(name))
                assert output.outputs[0].token_ids == references[name][index], (name, index)
        outputs = llm.generate(
            [{"prompt_token_ids": PROMPTS[1]}] * len(names),
            params,
            use_tqdm=False,
            lora_request=[loras.get(name) for name in names],
        )
    assert [o.outputs[0].token_ids for o in outputs] == [references[name][1] for name in names]
