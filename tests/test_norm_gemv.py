"""The norm-carrying decode step (ZLLM_NORM_GEMV, models/llama.py carry_norms and
forward_carrying_norms) on the CPU, where its unfused fallbacks run over the folded weights (the
GEMV builds themselves: tests/gpu/test_norm_gemv_gpu.py): in fp32 the usual step's tokens and
logprobs at tp 1 and at tp 2 (gloo: the first rank adds the residual before the all-reduce);
the fold itself; auto leaves the CPU's step alone; q/k norms and LoRA keep the usual step."""

from __future__ import annotations

import pytest

from tests.helpers.models import save_tiny_llama, save_tiny_model
from zllm import LLM, SamplingParams, envs
from zllm.workers.models.llama import LlamaForCausalLM

PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 40, 41, 42, 7], [64]]


def _decode(model_dir, **engine_args) -> tuple[list[list[int]], list[list[dict]]]:
    """Greedy tokens and top-3 logprobs, one sequence at a time (every decode step one row)."""
    llm = LLM(str(model_dir), max_num_seqs=1, max_model_len=128, kv_cache_memory_bytes=4 << 20, **engine_args)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs


@pytest.fixture
def carried_calls(monkeypatch) -> list[int]:
    """Counts the carried forwards of this process's (in-process) worker."""
    calls: list[int] = []
    carried = LlamaForCausalLM._forward_carrying_norms

    def spied(self, *args):
        calls.append(1)
        return carried(self, *args)

    monkeypatch.setattr(LlamaForCausalLM, "_forward_carrying_norms", spied)
    return calls


def test_the_switch_reads_auto_on_and_off(monkeypatch):
    monkeypatch.delenv("ZLLM_NORM_GEMV", raising=False)
    assert envs.ZLLM_NORM_GEMV is None
    monkeypatch.setenv("ZLLM_NORM_GEMV", "1")
    assert envs.ZLLM_NORM_GEMV is True
    monkeypatch.setenv("ZLLM_NORM_GEMV", "0")
    assert envs.ZLLM_NORM_GEMV is False


def _assert_same_decode(actual, expected, tol: float = 1e-4) -> None:
    tokens, logprobs = actual
    assert tokens == expected[0]
    for row, expected_row in zip(logprobs, expected[1]):
        for a, b in zip(row, expected_row):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < tol for t in a), (a, b)


def test_carried_step_at_tp_1_gives_the_usual_tokens(tmp_path, monkeypatch, carried_calls):
    """fp32, biases included: the folded weights and the stream kept whole change only the
    rounding."""
    model_dir = save_tiny_llama(tmp_path / "m", attention_bias=True, mlp_bias=True)
    monkeypatch.setenv("ZLLM_NORM_GEMV", "0")
    expected = _decode(model_dir, dtype="float32")
    assert not carried_calls
    monkeypatch.setenv("ZLLM_NORM_GEMV", "1")
    _assert_same_decode(_decode(model_dir, dtype="float32"), expected)
    assert carried_calls, "the carried step never ran"


def test_carry_norms_folds_the_norm_weights_into_the_projections(tmp_path, monkeypatch):
    import torch

    model_dir = save_tiny_llama(tmp_path / "m")
    monkeypatch.setenv("ZLLM_NORM_GEMV", "0")
    before = LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
    try:
        model = before.engine.core.executor.runner.model
        layer = model.model.layers[1]
        gamma = layer.post_attention_layernorm.weight.detach().clone()
        gate_up = layer.mlp.gate_up_proj.weight.detach().clone()
        assert not torch.equal(gamma, torch.ones_like(gamma))
        assert model.carry_norms(enable_lora=True) is False  # adapters act on the normed input
        monkeypatch.setenv("ZLLM_NORM_GEMV", "1")
        assert model.carry_norms(enable_lora=False) is True
        assert torch.equal(layer.post_attention_layernorm.weight, torch.ones_like(gamma))
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up * gamma)
        assert model.carry_norms(enable_lora=False) is True  # a second call folds nothing
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up * gamma)
    finally:
        before.shutdown()


def test_auto_leaves_the_cpu_step_alone(tmp_path, monkeypatch, carried_calls):
    monkeypatch.delenv("ZLLM_NORM_GEMV", raising=False)
    _decode(save_tiny_llama(tmp_path / "m"), dtype="bfloat16")
    assert not carried_calls


def test_layers_it_does_not_take_keep_the_usual_step(tmp_path, monkeypatch, carried_calls):
    """Qwen3's q/k norms: the q/k/v epilogue cannot carry them, so the model keeps forward."""
    model_dir = save_tiny_model(tmp_path / "q", "qwen3", head_dim=16)
    monkeypatch.setenv("ZLLM_NORM_GEMV", "0")
    expected = _decode(model_dir, dtype="float32")
    monkeypatch.setenv("ZLLM_NORM_GEMV", "1")
    assert _decode(model_dir, dtype="float32") == expected
    assert not carried_calls


def test_lora_keeps_the_usual_step(tmp_path, monkeypatch, carried_calls):
    monkeypatch.setenv("ZLLM_NORM_GEMV", "1")
    _decode(save_tiny_llama(tmp_path / "m"), dtype="float32", enable_lora=True)
    assert not carried_calls


def test_carried_step_at_tp_2_gives_tp_1s_tokens(tmp_path, monkeypatch, capfd):
    """gloo sums in the dtype: each rank's partial is all-reduced and the residual added after
    (RowParallelLinear.add_to); both ranks log that they carry the norms."""
    model_dir = save_tiny_llama(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    monkeypatch.setenv("ZLLM_NORM_GEMV", "0")
    tokens, logprobs = _decode(model_dir, dtype="float32")
    capfd.readouterr()
    monkeypatch.setenv("ZLLM_NORM_GEMV", "1")
    _assert_same_decode(_decode(model_dir, dtype="float32", tensor_parallel_size=2), (tokens, logprobs))
    out, err = capfd.readouterr()
    assert (out + err).count("ZLLM_NORM_GEMV: the norms of 2 layers folded") == 2, err[-2000:]


class _OneShot:
    """A stand-in for the symmetric-memory all-reduce (sums in fp32): takes every tensor and
    hands it back, so a test adds the ranks' outputs itself."""

    def accepts(self, x) -> bool:
        return True

    def all_reduce(self, x):
        return x


@pytest.mark.parametrize("fast", [True, False], ids=["fp32-sum", "nccl"])
def test_add_to_adds_the_residual_and_bias_once_over_the_ranks(fast):
    """The first rank's partial carries the residual and the bias where the all-reduce sums in
    fp32; with NCCL the sum comes first and they are added after: either way the ranks' outputs
    sum to residual + x @ w^T + bias."""
    import torch

    from zllm.partition import Span
    from zllm.workers.distributed import TensorParallel
    from zllm.workers.parallel_layers import RowParallelLinear

    gen = torch.Generator().manual_seed(0)
    full_w = torch.randn(8, 12, generator=gen, dtype=torch.float64)
    bias = torch.randn(8, generator=gen, dtype=torch.float64)
    x = torch.randn(1, 12, generator=gen, dtype=torch.float64)
    residual = torch.randn(1, 8, generator=gen, dtype=torch.float64)

    class NcclStandIn(TensorParallel):
        """NCCL's in-place sum over two ranks, the other rank's part given."""

        def __init__(self, rank: int, other: torch.Tensor) -> None:
            super().__init__(rank=rank, size=2)
            self.other = other

        def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
            return t.add_(self.other)

    outputs = []
    for rank in range(2):
        cols = slice(6 * (1 - rank), 6 * (1 - rank) + 6)  # the other rank's columns
        if fast:
            tp = TensorParallel(rank=rank, size=2, fast=_OneShot())
        else:
            tp = NcclStandIn(rank, x[:, cols] @ full_w[:, cols].t())
        layer = RowParallelLinear(12, 8, Span(6 * rank, 6), True, tp).double()
        with torch.no_grad():
            layer.weight.copy_(full_w[:, 6 * rank : 6 * rank + 6])
            layer.bias.copy_(bias)
        outputs.append(layer.add_to(x[:, 6 * rank : 6 * rank + 6], residual))
    expected = residual + x @ full_w.t() + bias
    if fast:  # each rank's part, summed here as the all-reduce would
        torch.testing.assert_close(outputs[0] + outputs[1], expected)
    else:  # every rank holds the whole stream
        for out in outputs:
            torch.testing.assert_close(out, expected)


class _Pushing(_OneShot):
    """A stand-in for the symmetric-memory path with the GEMV push on (ZLLM_GEMV_PUSH): its
    gemv_all_reduce computes what the _push build would store for this rank (the product, plus the
    bias and residual it is given), so a test adds the ranks' parts itself."""

    def __init__(self, takes: bool) -> None:
        self.takes = takes
        self.calls = []

    def takes_pushed(self, rows: int, dtype) -> bool:
        return self.takes

    def gemv_all_reduce(self, x, weight, bias, add):
        self.calls.append((bias is not None, add is not None))
        out = x @ weight.t()
        return out + (0 if bias is None else bias) + (0 if add is None else add)


@pytest.mark.parametrize("takes", [True, False], ids=["pushed", "stored"])
def test_add_to_pushes_where_the_lamport_path_takes_the_product(takes, monkeypatch):
    """At tp > 1 add_to hands a dense one-row product to gemv_all_reduce where the path takes it:
    the first rank with its bias and the residual, the others with neither, and the parts still
    sum to residual + x @ w^T + bias; where it does not, the stored product is all-reduced."""
    import torch

    from zllm.partition import Span
    from zllm.workers import parallel_layers
    from zllm.workers.distributed import TensorParallel
    from zllm.workers.parallel_layers import RowParallelLinear

    monkeypatch.setattr(parallel_layers, "gemv_takes_one_row", lambda x, w: True)  # the CUDA build's answer
    gen = torch.Generator().manual_seed(1)
    full_w = torch.randn(8, 12, generator=gen, dtype=torch.float64)
    bias = torch.randn(8, generator=gen, dtype=torch.float64)
    x = torch.randn(1, 12, generator=gen, dtype=torch.float64)
    residual = torch.randn(1, 8, generator=gen, dtype=torch.float64)
    outputs, fasts = [], []
    for rank in range(2):
        fasts.append(_Pushing(takes))
        layer = RowParallelLinear(12, 8, Span(6 * rank, 6), True, TensorParallel(rank=rank, size=2, fast=fasts[-1]))
        layer = layer.double()
        with torch.no_grad():
            layer.weight.copy_(full_w[:, 6 * rank : 6 * rank + 6])
            layer.bias.copy_(bias)
        outputs.append(layer.add_to(x[:, 6 * rank : 6 * rank + 6], residual))
    torch.testing.assert_close(outputs[0] + outputs[1], residual + x @ full_w.t() + bias)
    assert [f.calls for f in fasts] == ([[(True, True)], [(False, False)]] if takes else [[], []])


def test_add_to_keeps_the_stored_product_for_lora_other_weights_and_other_dtypes(monkeypatch):
    """Where the path takes the size, _pushes still says no for a layer with LoRA, weights that
    are not DenseWeights (FP8), and a residual of another dtype than x."""
    import torch

    from zllm.partition import Span
    from zllm.workers import parallel_layers
    from zllm.workers.distributed import TensorParallel
    from zllm.workers.parallel_layers import RowParallelLinear

    monkeypatch.setattr(parallel_layers, "gemv_takes_one_row", lambda x, w: True)
    layer = RowParallelLinear(12, 8, Span(0, 6), False, TensorParallel(rank=0, size=2, fast=_Pushing(True)))
    x, residual = torch.zeros(1, 6), torch.zeros(1, 8)
    assert layer._pushes(x, residual)
    assert not layer._pushes(x, residual.double())
    layer.lora = object()  # any adapter: it acts on the layer's input, which the push does not see
    assert not layer._pushes(x, residual)
    layer.lora = None
    layer.weights = object()  # FP8's Fp8Weights, say: not the b6 GEMV's dense rows
    assert not layer._pushes(x, residual)
