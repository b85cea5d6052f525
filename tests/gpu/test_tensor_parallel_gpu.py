"""Tensor parallelism on two GPUs (NCCL), and four where there are: tp 2 and tp 4 greedy vs HF in
fp32, CUDA graphs (with the all-reduce captured) vs eager in bf16; the symmetric-memory one-shot
all-reduce (--custom-all-reduce-max-size) against NCCL, alone and in the engine. The models and
prompts are tests/gpu/conftest.py's model_dir and prompt_ids, as in test_engine_gpu."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.gpu import engine_tokens, hf_tokens, record, share_identical
from zllm import envs

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def _needs_gpus(count: int) -> None:
    import torch

    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs")


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_fp32_greedy_is_token_identical_to_hf(model_dir, prompt_ids, tp):
    import torch

    _needs_gpus(tp)
    ours = engine_tokens(model_dir, prompt_ids, dtype="float32", tensor_parallel_size=tp)
    theirs = hf_tokens(model_dir, prompt_ids, torch.float32)
    record(f"tp{tp}_fp32_share_identical[{os.path.basename(model_dir)}]", share_identical(ours, theirs))
    assert ours == theirs


def test_tensor_parallel_cuda_graphs_equal_eager(model_dir, prompt_ids):
    # Steps with prefill off the graphs (mixed_graph_max_tokens=0, the pieces off): the decode
    # graphs alone replay eager bit for bit.
    graphs = engine_tokens(
        model_dir,
        prompt_ids,
        dtype="bfloat16",
        tensor_parallel_size=2,
        mixed_graph_max_tokens=0,
        piecewise_cuda_graphs=False,
    )
    eager = engine_tokens(model_dir, prompt_ids, dtype="bfloat16", tensor_parallel_size=2, enforce_eager=True)
    record(
        f"tp2_bf16_share_identical_vs_tp1[{os.path.basename(model_dir)}]",
        share_identical(graphs, engine_tokens(model_dir, prompt_ids, dtype="bfloat16")),
    )
    assert graphs == eager


# ---- the symmetric-memory one-shot all-reduce ----------------------------------------------------

SYMMETRIC_LIMIT = 64 << 10  # bytes: bf16 [8, 4096] is exactly at the limit
SYMMETRIC_CASES = [
    ((1, 64), "bfloat16"),
    ((1, 4096), "bfloat16"),
    ((8, 4096), "bfloat16"),
    ((9, 4096), "bfloat16"),
    ((64, 4096), "bfloat16"),
    ((1, 4096), "float32"),
]
RANK_TIMEOUT_S = 240.0


def _symmetric_rank(rank: int, size: int, init_file: str, lamport: str) -> None:
    """One rank: TensorParallel.all_reduce with the one-shot path on equals NCCL's all_reduce, for
    sizes below, at and above the limit and another dtype, eagerly and replayed from a CUDA graph.
    `lamport` is ZLLM_ALLREDUCE_LAMPORT: "0" for PyTorch's one-shot kernel, "auto" for the default
    (the Lamport kernel at tp 2 and 4)."""
    import logging
    import os

    os.environ["ZLLM_ALLREDUCE_LAMPORT"] = lamport

    import torch
    import torch.distributed as dist

    from zllm.config import EngineConfig
    from zllm.workers.distributed import TensorParallel
    from zllm.workers.symmetric_all_reduce import attach_symmetric_all_reduce, lamport_by_default

    logging.basicConfig(level=logging.INFO)  # the set-up's messages, to the test's log
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", world_size=size, rank=rank, device_id=device)
    tp = TensorParallel(rank=rank, size=size)
    attach_symmetric_all_reduce(
        tp, EngineConfig(model="", custom_all_reduce_max_bytes=SYMMETRIC_LIMIT), device, torch.bfloat16
    )
    assert tp.fast is not None, f"rank {rank}: set-up fell back to NCCL (see the warnings above)"
    lamport_expected = lamport == "auto" and lamport_by_default(size)
    assert (tp.fast.lamport is not None) == lamport_expected, f"rank {rank}: Lamport set-up with {lamport}"
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    inputs = [
        torch.randn(shape, generator=gen, device=device).to(getattr(torch, dtype)) for shape, dtype in SYMMETRIC_CASES
    ]
    for x in inputs:
        nbytes = x.numel() * x.element_size()
        assert tp.fast.accepts(x) == (x.dtype == torch.bfloat16 and nbytes <= SYMMETRIC_LIMIT)

    def nccl(x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    def compare(got, label):
        for (shape, dtype), x, y in zip(SYMMETRIC_CASES, inputs, got):
            expected = nccl(x)
            if size == 2:  # one rounding of a + b either way: the sums are bit-identical
                assert torch.equal(y, expected), f"rank {rank}: {label} {dtype}{list(shape)} differs from NCCL"
            else:  # more ranks add in another order (NCCL's ring vs rank order): a rounding or two apart
                torch.testing.assert_close(y, expected, rtol=2**-6, atol=2**-4, msg=f"rank {rank}: {label} {shape}")

    compare([tp.all_reduce(x.clone()) for x in inputs], "eager")
    static = [x.clone() for x in inputs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as DecodeGraphs does
        [tp.all_reduce(s.clone()) for s in static]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [tp.all_reduce(s.clone()) for s in static]
    for replay in range(3):
        inputs = [torch.randn(x.shape, generator=gen, device=device).to(x.dtype) for x in inputs]
        for s, x in zip(static, inputs):
            s.copy_(x)
        graph.replay()
        compare(outputs, f"graph replay {replay}")
    torch.cuda.synchronize()
    del graph
    tp.destroy()


@pytest.mark.parametrize("lamport", ["0", "auto"])
@pytest.mark.parametrize("size", [2, 4])
def test_symmetric_all_reduce_equals_nccl_eager_and_in_cuda_graphs(tmp_path, size, lamport):
    import torch.multiprocessing as mp

    _needs_gpus(size)
    context = mp.start_processes(
        _symmetric_rank,
        args=(size, str(tmp_path / "rendezvous"), lamport),
        nprocs=size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while not context.join(timeout=5):  # raises with the rank's traceback if one failed
            assert time.monotonic() < deadline, f"ranks still running after {RANK_TIMEOUT_S:.0f} s: a hang"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tensor_parallel_symmetric_all_reduce_gives_nccls_tokens(model_dir, prompt_ids, dtype, capfd):
    """The engine at tp 2 (CUDA graphs, async scheduling) with the symmetric-memory path on (the
    Lamport kernel, tp 2's default) and off."""
    fast = engine_tokens(
        model_dir, prompt_ids, dtype=dtype, tensor_parallel_size=2, custom_all_reduce_max_bytes=8 << 20
    )
    log = capfd.readouterr().err
    assert log.count("symmetric-memory one-shot all-reduce for") == 2, "set-up fell back to NCCL:\n" + log[-4000:]
    if envs.ZLLM_ALLREDUCE_LAMPORT is None:  # auto: tp 2's default is Lamport
        assert log.count("Lamport all-reduce (ZLLM_ALLREDUCE_LAMPORT)") == 2, "Lamport fell back:\n" + log[-4000:]
    nccl = engine_tokens(model_dir, prompt_ids, dtype=dtype, tensor_parallel_size=2)
    record(f"tp2_{dtype}_symmetric_share_identical_vs_nccl[{os.path.basename(model_dir)}]", share_identical(fast, nccl))
    assert fast == nccl


def test_tp4_symmetric_all_reduce_fp32_greedy_is_token_identical_to_hf(model_dir, prompt_ids, capfd):
    """At tp 4 the symmetric-memory kernels (Lamport, tp 4's default, or the one-shot kernel) sum
    four partials in rank order, NCCL in its ring's: bf16 tokens may part ways on near-ties, so
    the check is fp32's, against transformers."""
    import torch

    _needs_gpus(4)
    fast = engine_tokens(
        model_dir, prompt_ids, dtype="float32", tensor_parallel_size=4, custom_all_reduce_max_bytes=8 << 20
    )
    log = capfd.readouterr().err
    assert log.count("symmetric-memory one-shot all-reduce for") == 4, "set-up fell back to NCCL:\n" + log[-4000:]
    if envs.ZLLM_ALLREDUCE_LAMPORT is None:  # auto: tp 4's default is Lamport
        assert log.count("Lamport all-reduce (ZLLM_ALLREDUCE_LAMPORT)") == 4, "Lamport fell back:\n" + log[-4000:]
    theirs = hf_tokens(model_dir, prompt_ids, torch.float32)
    record(f"tp4_fp32_symmetric_share_identical_vs_hf[{os.path.basename(model_dir)}]", share_identical(fast, theirs))
    assert fast == theirs


def _tokens_one_request_at_a_time(model_dir, prompt_ids, **engine_args) -> list[tuple[list[int], float]]:
    """Greedy tokens of each prompt run alone (every decode step at batch 1), in one engine, each
    with the sum of their logprobs (the same bits in, the same float out)."""
    from zllm import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(model_dir, device="cuda", max_model_len=2048, **engine_args)
    results = []
    try:
        params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1)
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                results += [
                    (list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob) for o in engine.step() if o.finished
                ]
    finally:
        engine.shutdown()
    return results


def test_tp2_gemv_push_gives_the_tokens_of_the_stored_product(model_dir, prompt_ids, capfd, monkeypatch):
    """ZLLM_GEMV_PUSH: at batch 1 the norm-carrying step's o and down GEMVs push their rows into
    the Lamport buffers and one launch sums them, with the bits of the Lamport all-reduce of the
    stored products (tests/gpu/test_gemv_push_gpu.py): bf16 tokens and logprobs at tp 2 are the
    same with it on and off. Qwen3's q/k norms keep the usual step, so nothing is pushed there."""
    if envs.ZLLM_ALLREDUCE_LAMPORT is False or envs.ZLLM_NORM_GEMV is False:
        pytest.skip("the push needs the Lamport all-reduce and the norm-carrying step")
    prompts = [prompt_ids[2], prompt_ids[-1]]
    args = dict(dtype="bfloat16", tensor_parallel_size=2, custom_all_reduce_max_bytes=8 << 20)
    monkeypatch.setenv("ZLLM_GEMV_PUSH", "1")
    pushed = _tokens_one_request_at_a_time(model_dir, prompts, **args)
    log = capfd.readouterr().err
    expected = 0 if "qwen3" in os.path.basename(model_dir) else 2
    assert log.count("pushes its rows into the Lamport buffers") == expected, log[-4000:]
    monkeypatch.setenv("ZLLM_GEMV_PUSH", "0")
    stored = _tokens_one_request_at_a_time(model_dir, prompts, **args)
    assert "pushes its rows" not in capfd.readouterr().err
    record(
        f"tp2_bf16_push_share_identical[{os.path.basename(model_dir)}]",
        share_identical([t for t, _ in pushed], [t for t, _ in stored]),
    )
    assert all(logprob is not None for _, logprob in pushed)
    assert pushed == stored  # tokens and their logprobs
