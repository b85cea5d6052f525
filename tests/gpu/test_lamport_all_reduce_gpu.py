"""The Lamport all-reduce (csrc/allreduce_kernels.cu `lamport_all_reduce`, ZLLM_ALLREDUCE_LAMPORT) on
2, 4 and 8 GPUs, with programmatic dependent launch on and off: bit for bit the exact rank-order
fp32 sum rounded once, the same bits on every rank, close to NCCL's; launches of growing and
shrinking sizes back to back (every slot reused, a slot cleared by its own last size); a run of
launches with no collective between them and one rank or another held back on the GPU
(torch.cuda._sleep), so ranks drift a launch apart as the slots allow; negative zeros (the "empty"
mark) arriving as zeros; a decode-like chain in CUDA-graph replays with new inputs, then 300
replays of the same inputs that must give the same bits. Then the engine's fp32 tokens at tp 2
with it (and with its fused add-RMSNorm form) equal the one-shot kernel's. The fused form's own
bit-for-bit checks: tests/gpu/test_allreduce_norm_gpu.py's lamport cases."""

from __future__ import annotations

import os
import random
import time

import pytest

from tests.helpers.gpu import engine_tokens

pytestmark = [pytest.mark.gpu]

LIMIT = 1 << 20  # --custom-all-reduce-max-size: every case below fits
# (rows, hidden): batch-1 decode of the 8B and 70B shapes, a batch of 4, the largest tensor the
# limit takes in bf16 (64 x 8192, 1 MiB: 4 units a thread), a small odd one, then batch 1 again
# (smaller than the slot's last launch).
SIZES = [(1, 8192), (4, 8192), (64, 8192), (3, 4096), (1, 8), (1, 4096), (1, 8192)]
RANK_TIMEOUT_S = 240.0


def _needs_gpus(count: int) -> None:
    import torch

    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs")


def _rank(rank: int, size: int, init_file: str, dtype_name: str, pdl: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    os.environ["ZLLM_ALLREDUCE_LAMPORT"] = "1"
    os.environ["ZLLM_PDL"] = pdl
    from zllm.config import EngineConfig
    from zllm.workers import kernels
    from zllm.workers.distributed import TensorParallel
    from zllm.workers.symmetric_all_reduce import attach_symmetric_all_reduce

    logging.basicConfig(level=logging.INFO)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dtype = getattr(torch, dtype_name)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", world_size=size, rank=rank, device_id=device)
    tp = TensorParallel(rank=rank, size=size)
    kernels.preload(device)
    attach_symmetric_all_reduce(tp, EngineConfig(model="", custom_all_reduce_max_bytes=LIMIT), device, dtype)
    assert tp.fast is not None and tp.fast.lamport is not None, f"rank {rank}: Lamport set-up fell back (see above)"
    sizes = [(r, h) for r, h in SIZES if r * h * dtype.itemsize <= LIMIT]
    gen = torch.Generator(device=device).manual_seed(300 + rank)

    def draw(rows, hidden):
        return torch.randn(rows, hidden, generator=gen, device=device).to(dtype)

    def check(x, summed, label):
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x)
        exact = parts[0].float()
        for p in parts[1:]:
            exact = exact + p.float()
        assert torch.equal(summed, exact.to(dtype)), f"rank {rank}: {label}: differs from the rank-order fp32 sum"
        nccl = x.clone()
        dist.all_reduce(nccl)  # NCCL's own order: a rounding or two apart in bf16
        torch.testing.assert_close(summed, nccl, rtol=2**-6, atol=2**-5, msg=f"{label}: vs NCCL")
        everyone = [torch.empty_like(summed) for _ in range(size)]
        dist.all_gather(everyone, summed)
        assert all(torch.equal(o, everyone[0]) for o in everyone), f"{label}: ranks differ"

    # Eager, every size twice in a row and then in reverse: each slot reused with other sizes.
    for rows, hidden in sizes + sizes[::-1]:
        x = draw(rows, hidden)
        assert tp.fast.accepts(x)
        before = x.clone()
        summed = tp.all_reduce(x)
        assert torch.equal(x, before), "the input was changed"
        check(x, summed, f"eager {rows}x{hidden}")
    # The device keeps the next launch's slot (not a count that would wrap): the self-test's
    # launches and these, mod 3.
    from zllm.workers.symmetric_all_reduce import _LAMPORT_TEST_SIZES

    launches = len(_LAMPORT_TEST_SIZES) + 2 * len(sizes)
    assert int(tp.fast.lamport.flags[0]) == launches % 3, f"rank {rank}: slot {int(tp.fast.lamport.flags[0])}"

    # Back to back with no collective between: before some launches one rank (a different one
    # each time) spins on the GPU first, so its peers run ahead and wait; checked afterwards.
    pace = random.Random(11)  # the same schedule on every rank
    held = []
    for _ in range(40):
        rows, hidden = sizes[pace.randrange(len(sizes))]
        slow, cycles = pace.randrange(size), pace.choice([0, 20_000, 200_000, 2_000_000])
        if slow == rank and cycles:
            torch.cuda._sleep(cycles)
        x = draw(rows, hidden)
        held.append((x, tp.all_reduce(x)))
    torch.cuda.synchronize()
    for i, (x, summed) in enumerate(held):
        check(x, summed, f"skewed launch {i} {tuple(x.shape)}")

    # Negative zeros on every rank (the buffer's "empty" mark) arrive: their sum is zero.
    zeros = torch.full((2, 4096), -0.0, dtype=dtype, device=device)
    summed = tp.all_reduce(zeros)
    torch.cuda.synchronize()
    assert bool((summed == 0).all()), f"rank {rank}: negative zeros summed to {summed.unique().tolist()}"
    mixed = draw(1, 8192)
    mixed[0, ::3] = -0.0  # some of every unit
    check(mixed, tp.all_reduce(mixed), "partly negative zeros")

    # A decode-like chain in a CUDA graph (two all-reduces a layer, 8 layers, batch 1, and one of
    # another size), replayed with new inputs: the slot and the sizes live on the device.
    hidden = 8192
    inputs = [draw(1, hidden) for _ in range(16)] + [draw(4, 1024)]

    def step():
        return [tp.all_reduce(x) for x in inputs]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for replay in range(5):
        for x in inputs:
            x.copy_(draw(*x.shape))
        graph.replay()
        torch.cuda.synchronize()
        for i, (x, out) in enumerate(zip(inputs, outputs)):
            check(x, out, f"graph replay {replay}, all-reduce {i}")
        # An eager launch between replays shares the slots with the graph's.
        x = draw(2, 2048)
        check(x, tp.all_reduce(x), f"eager after replay {replay}")
    # Many replays of the same inputs: the same bits every time (each replay goes round the slots).
    first = [o.clone() for o in outputs]
    for replay in range(300):
        if replay % 50 == rank:
            torch.cuda._sleep(100_000)  # a rank behind now and then
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, f) for o, f in zip(outputs, first)), f"rank {rank}: replays differ"
    del graph
    tp.destroy()


@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "no-pdl"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_lamport_all_reduce_eager_and_in_cuda_graphs(tmp_path, size, dtype, pdl):
    import torch.multiprocessing as mp

    _needs_gpus(size)
    context = mp.start_processes(
        _rank, args=(size, str(tmp_path / "rendezvous"), dtype, pdl), nprocs=size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while not context.join(timeout=5):  # raises with the rank's traceback if one failed
            assert time.monotonic() < deadline, f"ranks still running after {RANK_TIMEOUT_S:.0f} s: a hang"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


@pytest.mark.parametrize("model_dir", ["gqa-d128"], indirect=True)
def test_engine_tokens_with_lamport_all_reduce_and_its_fused_norm_equal_one_shot_fp32_tp2(
    model_dir, prompt_ids, monkeypatch, capfd
):
    """fp32 at tp 2: the one-shot sum a + b and the Lamport kernel's are one rounding each, and the
    fused form's norm is fused_add_rms_norm's, so the tokens must be identical (CUDA graphs on)."""
    _needs_gpus(2)
    monkeypatch.setenv("ZLLM_ALLREDUCE_LAMPORT", "0")  # tp 2's default is Lamport
    one_shot = engine_tokens(
        model_dir, prompt_ids, dtype="float32", tensor_parallel_size=2, custom_all_reduce_max_bytes=8 << 20
    )
    monkeypatch.setenv("ZLLM_ALLREDUCE_LAMPORT", "1")
    lamport = engine_tokens(
        model_dir, prompt_ids, dtype="float32", tensor_parallel_size=2, custom_all_reduce_max_bytes=8 << 20
    )
    monkeypatch.setenv("ZLLM_ALLREDUCE_NORM", "1")
    lamport_norm = engine_tokens(
        model_dir, prompt_ids, dtype="float32", tensor_parallel_size=2, custom_all_reduce_max_bytes=8 << 20
    )
    log = capfd.readouterr().err
    assert log.count("Lamport all-reduce (ZLLM_ALLREDUCE_LAMPORT)") == 4, "Lamport set-up fell back:\n" + log[-4000:]
    assert log.count("fused all-reduce + add-RMSNorm kernel on") == 2, "fused set-up fell back:\n" + log[-4000:]
    assert lamport == one_shot
    assert lamport_norm == one_shot
