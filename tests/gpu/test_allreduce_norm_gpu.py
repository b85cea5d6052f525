"""The fused all-reduce + residual add + RMSNorm (csrc/allreduce_kernels.cu, ZLLM_ALLREDUCE_NORM) on
2 and 4 GPUs: against NCCL's all-reduce and the torch add + RMSNorm, against the exact rank-order
sum normed by the fused_add_rms_norm kernel (bit for bit), the same bits on every rank, eagerly
and in CUDA-graph replays with new inputs (between two one-shot all-reduces, which share the
signal pads); then the engine's tokens with the switch on and off. With ZLLM_ALLREDUCE_LAMPORT
too, the same checks run the Lamport kernel's form of it (lamport_all_reduce_add_rms_norm) between
Lamport all-reduces."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.gpu import engine_tokens

pytestmark = [pytest.mark.gpu]

LIMIT = 1 << 20  # the symmetric buffer: every case below fits
# (rows, hidden, dtype): batch-1 and small-batch decode of the 8B and 70B shapes, a 16384-wide row
# (two 16-byte units a thread), fp32.
CASES = [(1, 8192, "bfloat16"), (4, 8192, "bfloat16"), (8, 16384, "bfloat16"), (3, 4096, "bfloat16")]
EPS = 1e-5
RANK_TIMEOUT_S = 240.0


def _needs_gpus(count: int) -> None:
    import torch

    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs")


def _rank(rank: int, size: int, init_file: str, dtype_name: str, lamport: bool) -> None:
    import logging

    import torch
    import torch.distributed as dist

    os.environ["ZLLM_ALLREDUCE_NORM"] = "1"
    os.environ["ZLLM_ALLREDUCE_LAMPORT"] = "1" if lamport else "0"
    from zllm.config import EngineConfig
    from zllm.workers import kernels
    from zllm.workers.distributed import TensorParallel
    from zllm.workers.layers import rms_norm
    from zllm.workers.symmetric_all_reduce import attach_symmetric_all_reduce

    logging.basicConfig(level=logging.INFO)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dtype = getattr(torch, dtype_name)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", world_size=size, rank=rank, device_id=device)
    tp = TensorParallel(rank=rank, size=size)
    kernels.preload(device)
    attach_symmetric_all_reduce(tp, EngineConfig(model="", custom_all_reduce_max_bytes=LIMIT), device, dtype)
    assert tp.fast is not None and tp.fast.norm is not None, f"rank {rank}: fused set-up fell back (see above)"
    assert (tp.fast.lamport is not None) == lamport, f"rank {rank}: Lamport set-up fell back (see above)"
    norm = tp.fast.norm
    cases = [(rows, hidden) for rows, hidden, name in CASES if name == "bfloat16" or dtype != torch.bfloat16]
    cases = [(r, h) for r, h in cases if r * h * dtype.itemsize <= LIMIT]
    gen = torch.Generator(device=device).manual_seed(200 + rank)
    shared = torch.Generator(device=device).manual_seed(7)  # the residual and weight: one on every rank

    # Too many rows for the pad region: refused on every rank (the caller falls back).
    too_many = (norm.pad_words - norm.pad_base) // size + 1
    probe = torch.zeros(too_many, 16, dtype=dtype, device=device)
    assert not tp.fuses_add_rms_norm(probe, probe.clone(), torch.ones(16, dtype=dtype, device=device))

    def draw(rows, hidden):
        partial = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
        residual = torch.randn(rows, hidden, generator=shared, device=device).to(dtype)
        return partial, residual

    weight = {h: (1 + 0.1 * torch.randn(h, generator=shared, device=device)).to(dtype) for _, h in cases}

    def check(partial, residual_in, out, residual_out, label):
        hidden = partial.shape[1]
        parts = [torch.empty_like(partial) for _ in range(size)]
        dist.all_gather(parts, partial)
        exact = parts[0].float()
        for p in parts[1:]:
            exact = exact + p.float()
        x = exact.to(dtype)  # the rank-order fp32 sum, rounded once
        ref_x, ref_res = x.clone(), residual_in.clone()
        kernels.fused_add_rms_norm(ref_x, ref_res, weight[hidden], EPS)
        assert torch.equal(residual_out, ref_res), f"rank {rank}: {label}: residual differs from the exact sum's"
        assert torch.equal(out, ref_x), f"rank {rank}: {label}: norm differs from fused_add_rms_norm's bits"
        summed = partial.clone()
        dist.all_reduce(summed)  # NCCL, its own order: a rounding or two apart
        nccl_res = (residual_in.float() + summed.float()).to(dtype)
        torch.testing.assert_close(residual_out, nccl_res, rtol=2**-6, atol=2**-4, msg=f"{label}: vs NCCL")
        torch.testing.assert_close(
            out, rms_norm(nccl_res, weight[hidden], EPS), rtol=2**-5, atol=2**-4, msg=f"{label}: vs torch norm"
        )
        everyone = [torch.empty_like(out) for _ in range(size)]
        dist.all_gather(everyone, out)
        assert all(torch.equal(o, everyone[0]) for o in everyone), f"{label}: ranks differ"

    for rows, hidden in cases:
        partial, residual = draw(rows, hidden)
        assert tp.fuses_add_rms_norm(partial, residual, weight[hidden])
        residual_in = residual.clone()
        out, residual_out = tp.all_reduce_add_rms_norm(partial, residual, weight[hidden], EPS, False)
        assert residual_out.data_ptr() == residual.data_ptr()  # in place
        check(partial, residual_in, out, residual_out, f"eager {rows}x{hidden}")

    # In a CUDA graph, between one-shot all-reduces (the same signal pads), replayed with new inputs.
    statics = [draw(rows, hidden) for rows, hidden in cases]
    others = torch.randn(4, 1024, generator=gen, device=device).to(dtype)

    def step():
        outs = [tp.all_reduce(others)]
        for (p, r), (_, hidden) in zip(statics, cases):
            outs.append(tp.all_reduce_add_rms_norm(p, r, weight[hidden], EPS, False)[0])
        outs.append(tp.all_reduce(others))
        return outs

    keep = [r.clone() for _, r in statics]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for (_, r), k in zip(statics, keep):
        r.copy_(k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for replay in range(4):
        fresh = [draw(rows, hidden) for rows, hidden in cases]
        for (p, r), (fp, fr) in zip(statics, fresh):
            p.copy_(fp)
            r.copy_(fr)
        graph.replay()
        torch.cuda.synchronize()
        for (p, r), (_, fr), out in zip(statics, fresh, outputs[1:-1]):
            check(p, fr, out, r, f"graph replay {replay} {tuple(p.shape)}")
        summed = others.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(outputs[0], summed, rtol=2**-6, atol=2**-4)
        torch.testing.assert_close(outputs[-1], summed, rtol=2**-6, atol=2**-4)
    del graph
    tp.destroy()


@pytest.mark.parametrize("lamport", [False, True], ids=["barrier", "lamport"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("size", [2, 4])
def test_fused_all_reduce_add_rms_norm_eager_and_in_cuda_graphs(tmp_path, size, dtype, lamport):
    import torch.multiprocessing as mp

    _needs_gpus(size)
    context = mp.start_processes(
        _rank, args=(size, str(tmp_path / "rendezvous"), dtype, lamport), nprocs=size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while not context.join(timeout=5):  # raises with the rank's traceback if one failed
            assert time.monotonic() < deadline, f"ranks still running after {RANK_TIMEOUT_S:.0f} s: a hang"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def test_engine_tokens_with_fused_all_reduce_norm_equal_unfused_fp32_tp2(model_dir, prompt_ids, monkeypatch, capfd):
    """fp32 at tp 2: the one-shot sum a + b and the fused kernel's are one rounding each, and the
    norm is fused_add_rms_norm's: the tokens must be identical (CUDA graphs on). The barrier form:
    Lamport (tp 2's default) off."""
    _needs_gpus(2)
    monkeypatch.setenv("ZLLM_ALLREDUCE_LAMPORT", "0")
    unfused = engine_tokens(
        model_dir, prompt_ids, dtype="float32", tensor_parallel_size=2, custom_all_reduce_max_bytes=8 << 20
    )
    monkeypatch.setenv("ZLLM_ALLREDUCE_NORM", "1")
    fused = engine_tokens(
        model_dir, prompt_ids, dtype="float32", tensor_parallel_size=2, custom_all_reduce_max_bytes=8 << 20
    )
    log = capfd.readouterr().err
    assert log.count("fused all-reduce + add-RMSNorm kernel on") == 2, "fused set-up fell back:\n" + log[-4000:]
    assert fused == unfused
