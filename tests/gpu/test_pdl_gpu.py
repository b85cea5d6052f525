"""Programmatic dependent launch on the GPU (ZLLM_PDL; zllm/workers/kernels/pdl.py): the batch-1
kernels chained as a decode layer runs them, the LoRA kernels (shrink, expand, and the norm's
and the activation's shrink), and whole decode steps of a tiny Llama through LLM
(eager and CUDA graphs, bf16 and --quantization fp8), give the same bits with PDL as without.

Each kernel with PDL may start while the one before it still writes what it reads, so a missing
or misplaced griddepcontrol.wait shows as a difference here: the chain's buffers are poisoned with
NaN before each run, and a big GEMV precedes the small kernels that read its output. Needs sm_90+
(elsewhere nothing launches with PDL and the tests skip)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine import batch_one_decode
from zllm.workers import kernels
from zllm.workers.fp8 import quantize_rows
from zllm.workers.kernels import lora, matvec, pdl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not kernels.is_available(), reason="needs a CUDA GPU and CuPy")]

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128  # Llama-3-8B's layer
BLOCKS, BLOCK_SIZE = 4, 16
SLOT = 37  # the cache slot the layer's token is written to (its context: SLOT + 1 tokens)
REPEATS = 8


@pytest.fixture(autouse=True)
def _needs_sm90():
    if not pdl.supported(torch.cuda.get_device_capability()):
        pytest.skip("programmatic dependent launch needs sm_90+")


@pytest.fixture
def pdl_launches(monkeypatch) -> list[int]:
    """Counts the launches that go out through the driver with PDL (one entry each)."""
    launched, launch = [], pdl.launch

    def counted(*args):
        launched.append(1)
        return launch(*args)

    monkeypatch.setattr(pdl, "launch", counted)
    return launched


class Layer:
    """One decode layer's batch-1 kernels on random Llama-3-8B-shaped weights (bf16, or FP8 with
    per-row scales), in the order a step runs them, over static buffers (graph-capturable)."""

    def __init__(self, fp8_variant: str | None, attention: bool = False) -> None:
        g = torch.Generator(device="cuda").manual_seed(7)
        self.attention = attention

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

        self.fp8_variant = fp8_variant
        qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.weights = {
            "qkv": randn(qkv_rows, HIDDEN, scale=HIDDEN**-0.5),
            "o": randn(HIDDEN, HEADS * HEAD_DIM, scale=HIDDEN**-0.5),
            "gate_up": randn(2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
            "down": randn(HIDDEN, INTER, scale=INTER**-0.5),
        }
        self.fp8 = {name: quantize_rows(w) for name, w in self.weights.items()} if fp8_variant is not None else {}
        self.norms = [randn(HIDDEN, scale=0.1) + 1 for _ in range(3)]
        self.x0, self.residual0 = randn(1, HIDDEN), randn(1, HIDDEN)
        positions = torch.arange(4096, device="cuda", dtype=torch.float32)[:, None]
        inv_freq = 500000.0 ** (-torch.arange(0, HEAD_DIM, 2, device="cuda", dtype=torch.float32) / HEAD_DIM)
        self.cos, self.sin = (positions * inv_freq).cos(), (positions * inv_freq).sin()
        self.positions = torch.tensor([1234], device="cuda")
        self.slots = torch.tensor([SLOT], device="cuda")
        self.buffers = {
            "x": torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            "residual": torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            "qkv": torch.empty(1, qkv_rows, dtype=torch.bfloat16, device="cuda"),
            "o": torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            "gate_up": torch.empty(1, 2 * INTER, dtype=torch.bfloat16, device="cuda"),
            "act": torch.empty(1, INTER, dtype=torch.bfloat16, device="cuda"),
            "down": torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            "out": torch.empty(1, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            "kv_cache": torch.empty(2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
            "attn": torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
        }
        # The attention's context: SLOT + 1 tokens of random keys and values (the rotary kernel
        # writes the last, SLOT), two partitions of 32 (the reduce runs), a static workspace.
        self.context = randn(2, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.block_tables = torch.arange(BLOCKS, device="cuda", dtype=torch.int32)[None]
        self.seq_lens = torch.tensor([SLOT + 1], device="cuda", dtype=torch.int32)
        self.workspace = torch.zeros(1 << 16, device="cuda")

    def _linear(self, name: str, out: torch.Tensor, x: torch.Tensor) -> None:
        if self.fp8_variant is None:
            kernels.gemv(out, x, self.weights[name])
        else:
            q, scale = self.fp8[name]
            kernels.fp8_gemv(out, x, q, scale, variant=self.fp8_variant)

    def run(self) -> None:
        """Poison every buffer, then the layer: norm, qkv, rotary + cache, o, norm, gate_up,
        silu-and-mul, down, norm (the attention itself, not a PDL kernel, is left out: o reads q)."""
        b = self.buffers
        for buffer in b.values():
            buffer.fill_(float("nan"))
        if self.attention:  # a context to attend to; the slot the rotary kernel writes stays NaN
            b["kv_cache"].copy_(self.context)
            b["kv_cache"].view(2, -1, KV_HEADS, HEAD_DIM)[:, SLOT] = float("nan")
        b["x"].copy_(self.x0)
        b["residual"].copy_(self.residual0)
        kernels.fused_add_rms_norm(b["x"], b["residual"], self.norms[0], 1e-5)
        self._linear("qkv", b["qkv"], b["x"])
        q, k, v = b["qkv"].view(1, HEADS + 2 * KV_HEADS, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        kernels.rotary_embedding_and_cache(self.positions, q, k, v, self.cos, self.sin, b["kv_cache"], self.slots)
        if self.attention:
            kernels.paged_attention_decode(
                b["attn"],
                q,
                b["kv_cache"],
                self.block_tables,
                self.seq_lens,
                HEAD_DIM**-0.5,
                workspace=self.workspace,
                partition_size=32,
            )
            q = b["attn"]
        self._linear("o", b["o"], q.reshape(1, HEADS * HEAD_DIM))
        kernels.fused_add_rms_norm(b["o"], b["residual"], self.norms[1], 1e-5)
        self._linear("gate_up", b["gate_up"], b["o"])
        kernels.silu_and_mul(b["act"], b["gate_up"])
        self._linear("down", b["down"], b["act"])
        kernels.rms_norm(b["out"], b["down"], self.norms[2], 1e-5)

    def snapshot(self) -> dict[str, torch.Tensor]:
        cache = self.buffers["kv_cache"].view(2, -1, KV_HEADS, HEAD_DIM)[:, SLOT]  # the slot written
        return {**{k: v.clone() for k, v in self.buffers.items() if k != "kv_cache"}, "kv_slot": cache.clone()}


def _assert_same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), name


def _eager(layer: Layer, stream: torch.cuda.Stream | None) -> list[dict[str, torch.Tensor]]:
    runs = []
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        for _ in range(REPEATS):
            layer.run()
            runs.append(layer.snapshot())
    torch.cuda.synchronize()
    return runs


def _graphed(layer: Layer) -> list[dict[str, torch.Tensor]]:
    layer.run()  # modules loaded, shared memory opted in: nothing left for the capture to do
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.run()
    runs = []
    for _ in range(REPEATS):
        graph.replay()
        runs.append(layer.snapshot())
    torch.cuda.synchronize()
    return runs


@pytest.mark.parametrize("mode", ["eager_default_stream", "eager_side_stream", "graph"])
@pytest.mark.parametrize("fp8_variant", [None, "", "_split"], ids=["bf16", "fp8", "fp8_split"])
def test_layer_chain_is_bit_identical_with_pdl(mode, fp8_variant, monkeypatch, pdl_launches):
    layer = Layer(fp8_variant)

    def runs() -> list[dict[str, torch.Tensor]]:
        if mode == "graph":
            return _graphed(layer)
        return _eager(layer, torch.cuda.Stream() if mode == "eager_side_stream" else None)

    monkeypatch.setenv("ZLLM_PDL", "0")
    reference = runs()
    assert not pdl_launches
    monkeypatch.setenv("ZLLM_PDL", "1")
    with_pdl = runs()
    assert len(pdl_launches) >= 9  # every kernel of the layer (and its warm-up run, for the graph)
    for run in reference[1:]:
        _assert_same_bits(reference[0], run)  # the kernels themselves are deterministic
    for run in with_pdl:
        _assert_same_bits(reference[0], run)
    # And the reference is the layer: the last norm's output against torch in fp32 (bf16 tolerance).
    assert not reference[0]["out"].isnan().any()
    expected = _torch_tail(layer, reference[0])
    torch.testing.assert_close(reference[0]["out"].float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["eager_default_stream", "graph"])
@pytest.mark.parametrize("build", ["classic", "pipe"])
def test_decode_attention_in_the_chain_is_bit_identical_with_pdl(mode, build, monkeypatch, pdl_launches):
    """ZLLM_PDL_ATTENTION: the paged decode attention and its reduce between the rotary kernel
    (which writes the query and the context's last key and value: NaN until it has) and the o
    projection's GEMV, all with PDL, give the bits of the chain without it; and the attention is
    attention (torch, fp32, over the cache the run left)."""
    monkeypatch.setenv("ZLLM_DECODE_ATTENTION", build)
    layer = Layer(None, attention=True)

    def runs() -> list[dict[str, torch.Tensor]]:
        return _graphed(layer) if mode == "graph" else _eager(layer, None)

    monkeypatch.setenv("ZLLM_PDL", "0")
    monkeypatch.setenv("ZLLM_PDL_ATTENTION", "0")
    reference = runs()
    assert not pdl_launches
    monkeypatch.setenv("ZLLM_PDL", "1")
    pdl_only = runs()
    without_attention = len(pdl_launches)
    pdl_launches.clear()
    monkeypatch.setenv("ZLLM_PDL_ATTENTION", "1")
    with_pdl = runs()
    assert len(pdl_launches) > without_attention  # the attention and its reduce went out with PDL
    for run in [*reference[1:], *pdl_only, *with_pdl]:
        _assert_same_bits(reference[0], run)
    run = reference[0]
    assert not run["attn"].isnan().any() and not run["out"].isnan().any()
    q = run["qkv"].view(HEADS + 2 * KV_HEADS, HEAD_DIM)[:HEADS].float()
    cache = layer.context.view(2, -1, KV_HEADS, HEAD_DIM)[:, : SLOT + 1].float().clone()
    cache[:, SLOT] = run["kv_slot"].float()
    keys, values = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in cache)  # [tokens, heads, dim]
    scores = torch.einsum("hd,thd->ht", q, keys) * HEAD_DIM**-0.5
    expected = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
    torch.testing.assert_close(run["attn"][0].float(), expected, rtol=2e-2, atol=2e-2)


def _torch_tail(layer: Layer, run: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's last three steps in torch from the kernels' own gate_up output: silu-and-mul,
    down (the dequantized FP8 weights where the layer has them), RMS norm."""
    gate, up = run["gate_up"].float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate).bfloat16().float() * up).bfloat16().float()
    if layer.fp8_variant is None:
        down = layer.weights["down"].float()
    else:
        q, scale = layer.fp8["down"]
        down = q.float() * scale
    d = (act @ down.T).bfloat16().float()
    normed = (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16().float()
    return (normed * layer.norms[2].float()).bfloat16().float()


def test_the_gemv_builds_are_bit_identical_with_pdl(monkeypatch, pdl_launches):
    """Every dense GEMV bound and the FP8 rows-per-warp builds and _split, after a big GEMV that
    writes their input, on short and long rows (a second round of weight loads)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w_big = torch.randn(28672, 4096, generator=g, device="cuda").bfloat16() * 0.02
    x0 = torch.randn(1, 4096, generator=g, device="cuda").bfloat16()
    x = torch.empty(1, 28672, dtype=torch.bfloat16, device="cuda")
    for k in (4096, 14336, 272):
        w = torch.randn(1024, k, generator=g, device="cuda").bfloat16() * 0.02
        q, scale = quantize_rows(w)
        builds = [("dense", b) for b in ("", *matvec.GEMV_BOUNDS)]
        builds += [("fp8", v) for v in matvec.fp8_gemv_variants(with_splits=False) if "_mma" not in v]
        for kind, variant in builds:
            outs = {}
            for switch in ("0", "1"):
                monkeypatch.setenv("ZLLM_PDL", switch)
                x.fill_(float("nan"))
                out = torch.full((1, 1024), float("nan"), dtype=torch.bfloat16, device="cuda")
                kernels.gemv(x, x0, w_big)  # writes x while the next kernel may already load its weights
                if kind == "dense":
                    kernels.gemv(out, x[:, :k], w, variant=variant)
                else:
                    kernels.fp8_gemv(out, x[:, :k], q, scale, variant=variant)
                outs[switch] = out
            torch.cuda.synchronize()
            assert not outs["0"].isnan().any(), (kind, variant, k)
            assert torch.equal(outs["0"].view(torch.int16), outs["1"].view(torch.int16)), (kind, variant, k)
    assert pdl_launches


def _lora_chain(slot: int) -> dict[str, torch.Tensor]:
    """Each LoRA kernel right after a big GEMV (or shrink) that writes what it reads, on poisoned
    buffers at Llama-3-8B's widths (bf16, rank 16, 4 slots): lora_shrink of down's input,
    lora_expand of o's output (after the GEMV writing it, and after the shrink writing its t),
    fused_add_rms_norm_lora_shrink (q/k/v's 48 columns) and both activations' down shrink."""
    g = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

    w_big, x0 = randn(2 * INTER, HIDDEN, scale=HIDDEN**-0.5), randn(1, HIDDEN)
    w_o, residual, norm = randn(HIDDEN, HIDDEN, scale=HIDDEN**-0.5), randn(1, HIDDEN), randn(HIDDEN) + 1
    a_down, a_qkv = randn(4, 16, INTER, scale=INTER**-0.5), randn(4, 48, HIDDEN, scale=HIDDEN**-0.5)
    b_o = randn(HIDDEN, 4, 16, scale=0.25)
    slots = torch.tensor([slot], dtype=torch.int32, device="cuda")
    x = torch.empty(1, 2 * INTER, dtype=torch.bfloat16, device="cuda")
    got: dict[str, torch.Tensor] = {}

    def fresh(name: str, *shape, dtype=torch.float32) -> torch.Tensor:
        got[name] = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
        return got[name]

    def big() -> None:
        x.fill_(float("nan"))
        kernels.gemv(x, x0, w_big)  # writes x while the next kernel may already have started

    big()
    lora.lora_shrink(fresh("shrink", 1, 16), x[:, :INTER], a_down, slots)
    expand_t = fresh("expand_out", 1, HIDDEN, dtype=torch.bfloat16)
    expand_t.copy_(x0)
    lora.lora_expand(expand_t, got["shrink"], b_o, slots, [HIDDEN])  # t from the shrink just before
    gemv_out = fresh("gemv_expand", 1, HIDDEN, dtype=torch.bfloat16)
    kernels.gemv(gemv_out, x0, w_o)
    lora.lora_expand(gemv_out, got["shrink"], b_o, slots, [HIDDEN])  # out from the GEMV just before
    big()
    kernels.fused_add_rms_norm_lora_shrink(
        fresh("normed", 1, HIDDEN, dtype=torch.bfloat16),
        fresh("summed", 1, HIDDEN, dtype=torch.bfloat16),
        fresh("norm_t", 1, 48),
        x[:, :HIDDEN],
        residual,
        norm,
        a_qkv,
        slots,
        1e-5,
    )
    for name in ("silu_and_mul_lora_shrink", "gelu_tanh_and_mul_lora_shrink"):
        big()
        getattr(kernels, name)(fresh(name, 1, INTER, dtype=torch.bfloat16), fresh(f"{name}_t", 1, 16), x, a_down, slots)
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("slot", [2, -1])
def test_the_lora_kernels_are_bit_identical_with_pdl(slot, monkeypatch, pdl_launches):
    """ZLLM_PDL=1 against 0: every LoRA kernel's output, bit for bit (NaN-free, so none read a
    poisoned buffer), each launched with PDL."""
    monkeypatch.setenv("ZLLM_PDL", "0")
    reference = _lora_chain(slot)
    assert not pdl_launches
    monkeypatch.setenv("ZLLM_PDL", "1")
    with_pdl = _lora_chain(slot)
    assert len(pdl_launches) >= 11  # the five GEMVs, the six LoRA kernels
    for name, expected in reference.items():
        assert not expected.isnan().any(), name
        bits = torch.int32 if expected.dtype == torch.float32 else torch.int16
        assert torch.equal(expected.view(bits), with_pdl[name].view(bits)), name


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from tests.helpers.models import save_tiny_model

    directory = tmp_path_factory.mktemp("pdl-llama")
    save_tiny_model(
        directory,
        "llama",
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    return str(directory)


@pytest.mark.parametrize("attention", ["0", "1"], ids=["", "pdl_attention"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_decode_steps_are_bit_identical_with_pdl(
    tiny_llama, enforce_eager, quantization, attention, monkeypatch, pdl_launches
):
    args = dict(dtype="bfloat16", enforce_eager=enforce_eager, quantization=quantization)
    monkeypatch.setenv("ZLLM_PDL", "0")
    monkeypatch.setenv("ZLLM_PDL_ATTENTION", "0")
    tokens, logprobs = batch_one_decode(tiny_llama, **args)
    assert not pdl_launches
    monkeypatch.setenv("ZLLM_PDL", "1")
    monkeypatch.setenv("ZLLM_PDL_ATTENTION", attention)
    tokens_pdl, logprobs_pdl = batch_one_decode(tiny_llama, **args)
    assert pdl_launches
    assert tokens_pdl == tokens
    assert logprobs_pdl == logprobs
