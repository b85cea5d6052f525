"""csrc/activation_kernels.cu's silu_and_mul_lora_shrink / gelu_tanh_and_mul_lora_shrink
(ZLLM_LORA_NORM_SHRINK): the MLP's gated activation and the down projection's LoRA shrink in one
launch, against today's two kernels (silu/gelu_tanh_and_mul, then lora_shrink): the activation bit
for bit, the shrink to fp32 rounding and against a float64 oracle on the same rounded row; 1 to 8
rows of slots -1/0/3, Llama-3-8B's intermediate width (14336, down's 16 shrink columns at rank 16)
and a narrow one, both activations, three dtypes; the input left as it was; in a CUDA graph
replayed with new rows and slots; and a decoder layer on CUDA taking the launch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cupy")

from tests.helpers.kernels import DTYPE_IDS, DTYPES, randn  # noqa: E402
from tests.helpers.lora import NORM_HIDDEN, ShrinkCounts, run_lora_layer, tiny_lora_layer  # noqa: E402
from zllm.workers import kernels, ops  # noqa: E402
from zllm.workers.kernels.lora import lora_shrink  # noqa: E402

pytestmark = pytest.mark.gpu

ROW_SLOTS = {"1-slot-1": [-1], "1-slot0": [0], "1-slot3": [3], "3": [0, -1, 3], "8": [3, 0, -1, 0, 3, -1, 3, 0]}
ACTS = {"silu": (kernels.silu_and_mul, kernels.silu_and_mul_lora_shrink)}
ACTS["gelu_tanh"] = (kernels.gelu_tanh_and_mul, kernels.gelu_tanh_and_mul_lora_shrink)


def case(dtype, inter, cols, slots, gen, slot_count=4):
    """x (gate_up's output [rows, 2I]), A [S, cols, I] (adapter-sized entries) and the rows' slots."""
    x = randn(len(slots), 2 * inter, gen=gen, dtype=dtype) * 2
    a = (randn(slot_count, cols, inter, gen=gen) * (1.6 / inter**0.5)).to(dtype)
    return x, a, torch.tensor(slots, dtype=torch.int32, device="cuda")


def two_kernels(act, x, a, token_slots):
    """Today's path: the activation kernel, then lora_shrink of its output."""
    out = torch.full((x.shape[0], x.shape[1] // 2), float("nan"), dtype=x.dtype, device="cuda")
    ACTS[act][0](out, x)
    t = torch.full((x.shape[0], a.shape[1]), float("nan"), device="cuda")
    lora_shrink(t, out, a, token_slots)
    return out, t


def one_kernel(act, x, a, token_slots):
    out = torch.full((x.shape[0], x.shape[1] // 2), float("nan"), dtype=x.dtype, device="cuda")
    t = torch.full((x.shape[0], a.shape[1]), float("nan"), device="cuda")
    ACTS[act][1](out, t, x, a, token_slots)
    return out, t


def oracle(out, a, token_slots):
    """t in float64 from the rounded activation (lora_shrink's input), 0 for slot -1."""
    t = torch.zeros(out.shape[0], a.shape[1], dtype=torch.float64, device="cuda")
    for row, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            t[row] = a[slot].double() @ out[row].double()
    return t


def check(got, expected, a, token_slots):
    """The activation's bits; the shrink within fp32 rounding of lora_shrink's and the oracle's."""
    out, t = got
    assert torch.equal(out, expected[0])
    torch.testing.assert_close(t, expected[1], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(t.double(), oracle(out, a, token_slots), rtol=1e-5, atol=2e-5)
    assert torch.equal(t[token_slots < 0], torch.zeros_like(t[token_slots < 0]))


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inter", [256, 14336])
@pytest.mark.parametrize("slots", list(ROW_SLOTS.values()), ids=list(ROW_SLOTS))
def test_one_launch_equals_the_two_kernels(act, dtype, inter, slots, gen):
    x, a, token_slots = case(dtype, inter, 16, slots, gen)
    x0 = x.clone()
    check(one_kernel(act, x, a, token_slots), two_kernels(act, x, a, token_slots), a, token_slots)
    assert torch.equal(x, x0)  # not in place


def test_rejects_overlap_and_odd_shapes(gen):
    x, a, token_slots = case(torch.bfloat16, 256, 16, [0, 3], gen)
    t = torch.empty(2, 16, device="cuda")
    with pytest.raises(ValueError, match="overlap"):
        kernels.silu_and_mul_lora_shrink(x.view(-1)[:512].view(2, 256), t, x, a, token_slots)
    narrow = torch.empty(2, 14, device="cuda")  # 14 shrink columns: not whole blocks of 4
    with pytest.raises(ValueError, match="supported shape"):
        kernels.silu_and_mul_lora_shrink(torch.empty_like(x[:, :256]), narrow, x, a[:, :14].contiguous(), token_slots)


@pytest.mark.parametrize("act", list(ACTS))
def test_in_a_cuda_graph(act, gen):
    """Captured once at Llama-3-8B's width (bf16, down's 16 columns, 2 rows), replayed with new
    rows and the slots changed on the device: each replay equals the eager launch bit for bit and
    the two kernels to fp32 rounding."""
    kernels.preload()
    x, a, token_slots = case(torch.bfloat16, 14336, 16, [0, -1], gen)
    out, t = torch.empty(2, 14336, dtype=torch.bfloat16, device="cuda"), torch.empty(2, 16, device="cuda")

    def launch():
        ACTS[act][1](out, t, x, a, token_slots)

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
        x.copy_(randn(2, 2 * 14336, gen=gen, dtype=torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        replayed = (out.clone(), t.clone())
        assert all(torch.equal(r, e) for r, e in zip(replayed, one_kernel(act, x, a, token_slots)))
        check(replayed, two_kernels(act, x, a, token_slots), a, token_slots)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_decoder_layer_takes_the_one_launch(rows, act, monkeypatch):
    """A decoder layer on CUDA (fp32, adapters on every projection): with the switch on, down's
    shrink runs in the activation and q/k/v's and gate/up's in their norms (1 shrink launch a
    layer, o's, not 4), and the outputs equal the unfused path's to fp32 rounding."""
    results = {}
    for fused in (False, True):
        layer, _, gen = tiny_lora_layer(fused, rows, rows, device="cuda", hidden_act=act)
        x, residual, attended = (torch.randn(rows, NORM_HIDDEN, generator=gen).cuda() for _ in range(3))
        with monkeypatch.context() as patch:
            counts = ShrinkCounts(patch, ops.CudaOps)
            results[fused] = run_lora_layer(layer, x, residual, attended)
        assert (counts.alone, counts.in_norm, counts.in_act) == ((1, 2, 1) if fused else (4, 0, 0))
    for got, expected in zip(results[True], results[False]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
