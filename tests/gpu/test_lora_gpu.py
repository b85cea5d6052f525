"""LoRA on the GPU: csrc/lora_kernels.cu's shrink and expand, and zllm/workers/lora.py's dense
path (GEMMs over every slot), against a float64 oracle on the same rounded inputs for rows of
mixed slots, base rows and padding (1, 7, 33 and 300 rows; input widths of one shrink block's
step, of Llama-3-8B's hidden size and of its down projection); and the engine (CUDA graphs on)
against transformers + PEFT on a tiny Llama with four adapters in one batch: kernels only, dense
only, the default split between them, and the torch path (ZLLM_LORA_KERNELS=0)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import DTYPE_IDS, DTYPES, assert_close, nan_like, randn  # noqa: E402
from tests.helpers.lora import MAX_NEW, PROMPTS, SPECS, tiny_llama_with_adapters  # noqa: E402
from zllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from zllm.workers.kernels.lora import lora_expand, lora_shrink  # noqa: E402
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
