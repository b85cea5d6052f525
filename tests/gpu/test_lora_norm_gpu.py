"""csrc/layernorm_kernels.cu's fused_add_rms_norm_lora_shrink (ZLLM_LORA_NORM_SHRINK): the
add-RMSNorm and the next projection's LoRA shrink in one launch, against today's two kernels
(fused_add_rms_norm, then lora_shrink): the normalized row and the residual bit for bit, the
shrink to fp32 rounding and against a float64 oracle on the same rounded row; 1 to 8 rows of
slots -1/0/3, Llama-3-8B's width (4096: q/k/v's 48 and gate/up's 32 shrink columns at rank 16)
and a narrow one, Gemma's (1 + w) norm; the inputs left as they were; in a CUDA graph replayed
with new rows and slots; and the engine (tiny Llama, PEFT adapters, CUDA graphs) with the switch
on and off, equal to transformers + PEFT."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import DTYPE_IDS, DTYPES, randn  # noqa: E402
from tests.helpers.lora import (  # noqa: E402
    MAX_NEW,
    NORM_HIDDEN,
    PROMPTS,
    SPECS,
    ShrinkCounts,
    run_lora_layer,
    tiny_llama_with_adapters,
    tiny_lora_layer,
)
from zllm import LLM, LoRARequest, SamplingParams  # noqa: E402
from zllm.workers import kernels, ops  # noqa: E402
from zllm.workers.kernels.lora import lora_shrink  # noqa: E402

pytestmark = pytest.mark.gpu

EPS = 1e-5
ROW_SLOTS = {"1-slot-1": [-1], "1-slot0": [0], "1-slot3": [3], "3": [0, -1, 3], "8": [3, 0, -1, 0, 3, -1, 3, 0]}


def case(dtype, hidden, cols, slots, gen, slot_count=4):
    """x (an o/down output), the residual, the norm's weight, A [S, cols, hidden] (adapter-sized
    entries) and the rows' slots."""
    rows = len(slots)
    x = randn(rows, hidden, gen=gen, dtype=dtype)
    residual = randn(rows, hidden, gen=gen, dtype=dtype) * 4
    weight = (1 + 0.1 * randn(hidden, gen=gen)).to(dtype)
    a = (randn(slot_count, cols, hidden, gen=gen) * (1.6 / hidden**0.5)).to(dtype)
    token_slots = torch.tensor(slots, dtype=torch.int32, device="cuda")
    return x, residual, weight, a, token_slots


def two_kernels(x, residual, weight, a, token_slots, unit_offset):
    """Today's path: fused_add_rms_norm in place, then lora_shrink of its output."""
    normed, summed = x.clone(), residual.clone()
    kernels.fused_add_rms_norm(normed, summed, weight, EPS, unit_offset)
    t = torch.full((x.shape[0], a.shape[1]), float("nan"), device="cuda")
    lora_shrink(t, normed, a, token_slots)
    return normed, summed, t


def one_kernel(x, residual, weight, a, token_slots, unit_offset):
    normed, summed = torch.full_like(x, float("nan")), torch.full_like(residual, float("nan"))
    t = torch.full((x.shape[0], a.shape[1]), float("nan"), device="cuda")
    kernels.fused_add_rms_norm_lora_shrink(normed, summed, t, x, residual, weight, a, token_slots, EPS, unit_offset)
    return normed, summed, t


def oracle(normed, a, token_slots):
    """t in float64 from the rounded normalized row (lora_shrink's input), 0 for slot -1."""
    t = torch.zeros(normed.shape[0], a.shape[1], dtype=torch.float64, device="cuda")
    for row, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            t[row] = a[slot].double() @ normed[row].double()
    return t


def check(got, expected, a, token_slots):
    """The norm's bits; the shrink within fp32 rounding of lora_shrink's and of the oracle
    (sums of `hidden` products of magnitude ~|a||x|: a few ulps of the sum's scale)."""
    normed, summed, t = got
    assert torch.equal(normed, expected[0]) and torch.equal(summed, expected[1])
    torch.testing.assert_close(t, expected[2], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(t.double(), oracle(normed, a, token_slots), rtol=1e-5, atol=2e-5)
    assert torch.equal(t[token_slots < 0], torch.zeros_like(t[token_slots < 0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [256, 4096])
@pytest.mark.parametrize("cols", [48, 32], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("slots", list(ROW_SLOTS.values()), ids=list(ROW_SLOTS))
def test_one_launch_equals_the_two_kernels(dtype, hidden, cols, slots, gen):
    x, residual, weight, a, token_slots = case(dtype, hidden, cols, slots, gen)
    x0, residual0 = x.clone(), residual.clone()
    got = one_kernel(x, residual, weight, a, token_slots, False)
    check(got, two_kernels(x, residual, weight, a, token_slots, False), a, token_slots)
    assert torch.equal(x, x0) and torch.equal(residual, residual0)  # not in place


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_unit_offset_norm(dtype, gen):
    """Gemma's norm (1 + w, rounded once) through the same launch."""
    x, residual, weight, a, token_slots = case(dtype, 2048, 48, ROW_SLOTS["3"], gen)
    got = one_kernel(x, residual, weight, a, token_slots, True)
    check(got, two_kernels(x, residual, weight, a, token_slots, True), a, token_slots)


def test_rejects_in_place_and_odd_shapes(gen):
    x, residual, weight, a, token_slots = case(torch.bfloat16, 256, 48, [0, 3], gen)
    t = torch.empty(2, 48, device="cuda")
    with pytest.raises(ValueError, match="must not overlap"):
        kernels.fused_add_rms_norm_lora_shrink(x, residual.clone(), t, x, residual, weight, a, token_slots, EPS)
    narrow = torch.empty(2, 46, device="cuda")  # 46 shrink columns: not whole blocks of 4
    with pytest.raises(ValueError, match="supported shape"):
        kernels.fused_add_rms_norm_lora_shrink(
            x.clone(), residual.clone(), narrow, x, residual, weight, a[:, :46].contiguous(), token_slots, EPS
        )


def test_in_a_cuda_graph(gen):
    """Captured once at Llama-3-8B's width (bf16, q/k/v's 48 columns, 2 rows), replayed with new
    rows and the slots changed on the device: each replay equals the eager launch bit for bit and
    the two kernels to fp32 rounding."""
    kernels.preload()
    dtype, hidden = torch.bfloat16, 4096
    x, residual, weight, a, token_slots = case(dtype, hidden, 48, [0, -1], gen)
    normed, summed = torch.empty_like(x), torch.empty_like(residual)
    t = torch.empty(2, 48, device="cuda")

    def launch():
        kernels.fused_add_rms_norm_lora_shrink(normed, summed, t, x, residual, weight, a, token_slots, EPS)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up
        launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for slots in ([3, 0], [-1, 3], [0, 0]):
        token_slots.copy_(torch.tensor(slots, dtype=torch.int32))
        x.copy_(randn(2, hidden, gen=gen, dtype=dtype))
        residual.copy_(randn(2, hidden, gen=gen, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        replayed = (normed.clone(), summed.clone(), t.clone())
        eager = one_kernel(x, residual, weight, a, token_slots, False)
        assert all(torch.equal(r, e) for r, e in zip(replayed, eager))
        check(replayed, two_kernels(x, residual, weight, a, token_slots, False), a, token_slots)


@pytest.mark.parametrize("rows", [1, 5, 8])
def test_decoder_layer_takes_the_one_launch(rows, monkeypatch):
    """A decoder layer on CUDA (fp32, adapters on every projection, rows of slots -1/0/3/...): with
    the switch on, q/k/v's and gate/up's shrinks run in their norms and down's in the activation
    (tests/gpu/test_lora_act_gpu.py; 1 shrink launch a layer, not 4), and the outputs equal the
    unfused path's to fp32 rounding."""
    results = {}
    for fused in (False, True):
        layer, _, gen = tiny_lora_layer(fused, rows, rows, device="cuda")
        x, residual, attended = (torch.randn(rows, NORM_HIDDEN, generator=gen).cuda() for _ in range(3))
        with monkeypatch.context() as patch:
            counts = ShrinkCounts(patch, ops.CudaOps)
            results[fused] = run_lora_layer(layer, x, residual, attended)
        assert (counts.alone, counts.in_norm, counts.in_act) == ((1, 2, 1) if fused else (4, 0, 0))
    for got, expected in zip(results[True], results[False]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_dim 64: the smallest the CUDA attention kernels take.
    return tiny_llama_with_adapters(tmp_path_factory.mktemp("lora-norm-gpu"), head_dim=64)


@pytest.mark.parametrize("norm_shrink", ["1", "0"], ids=["on", "off"])
def test_engine_matches_peft(tiny, norm_shrink, monkeypatch):
    """Decode steps of 1 row (each adapter alone) and 5 rows (the base model and the four adapters
    on one prompt): the launches the fused norm takes; fp32, CUDA graphs on, ZLLM_LORA_NORM_SHRINK
    on and off: every output equals transformers + PEFT's greedy tokens (so the two agree)."""
    monkeypatch.setenv("ZLLM_LORA_NORM_SHRINK", norm_shrink)
    model_dir, adapters, references = tiny
    loras = {name: LoRARequest(name, i + 1, str(adapters / name)) for i, name in enumerate(SPECS)}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    names = ["base", *SPECS]
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=4, gpu_memory_utilization=0.3) as llm:
        for name in names:
            [output] = llm.generate(
                {"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False, lora_request=loras.get(name)
            )
            assert output.outputs[0].token_ids == references[name][1], name
        outputs = llm.generate(
            [{"prompt_token_ids": PROMPTS[2]}] * len(names),
            params,
            use_tqdm=False,
            lora_request=[loras.get(name) for name in names],
        )
    assert [o.outputs[0].token_ids for o in outputs] == [references[name][2] for name in names]
