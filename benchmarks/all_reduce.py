"""All-reduce latency between the GPUs of one machine: NCCL, PyTorch's symmetric-memory one-shot
all-reduce (zllm's default for decode-sized tensors) and zllm's barrier-free Lamport kernel
(ZLLM_ALLREDUCE_LAMPORT; csrc/allreduce_kernels.cu, set up as the engine sets it up: run from the
repository root with the csrc kernels available).

    python benchmarks/all_reduce.py --tp 2

Each rank is a process of this script. Every case is 50 back-to-back all-reduces of a bf16 tensor
[tokens, hidden] captured in one CUDA graph (as in a decode step), replayed 10 times; prints one
JSON line per case with the median microseconds per all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SHAPES = [(1, 4096), (1, 8192), (16, 8192), (64, 8192), (256, 8192), (1024, 8192)]
REDUCES_PER_GRAPH = 50


class NcclReduce:
    def all_reduce(self, x):
        import torch

        torch.distributed.all_reduce(x)
        return x


class OneShotReduce:
    """Peers' partial sums read over NVLink by one kernel, from a buffer in symmetric memory."""

    def __init__(self, numel: int, device) -> None:
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = torch.distributed.group.WORLD.group_name
        self.buffer = symm_mem.empty(numel, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def all_reduce(self, x):
        import torch

        out = torch.empty_like(x)
        staging = self.buffer[: x.numel()].view_as(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, out)
        return out


class LamportReduce:
    """zllm's Lamport all-reduce, through the engine's own set-up (attach_symmetric_all_reduce)."""

    def __init__(self, max_bytes: int, device, rank: int, size: int) -> None:
        import torch

        os.environ["ZLLM_ALLREDUCE_LAMPORT"] = "1"
        from zllm.config import EngineConfig
        from zllm.workers import kernels
        from zllm.workers.distributed import TensorParallel
        from zllm.workers.symmetric_all_reduce import attach_symmetric_all_reduce

        kernels.preload(device)
        self.tp = TensorParallel(rank=rank, size=size)
        config = EngineConfig(model="", custom_all_reduce_max_bytes=max_bytes)
        attach_symmetric_all_reduce(self.tp, config, device, torch.bfloat16)
        if self.tp.fast is None or self.tp.fast.lamport is None:
            raise RuntimeError(f"rank {rank}: the Lamport set-up fell back (see the log)")

    def all_reduce(self, x):
        return self.tp.fast.all_reduce(x)


def run_rank(rank: int, size: int, init_file: str) -> None:
    import torch

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.distributed.init_process_group(
        "nccl", init_method=f"file://{init_file}", world_size=size, rank=rank, device_id=device
    )
    largest = max(t * h for t, h in SHAPES)
    methods = {
        "nccl": NcclReduce(),
        "symmetric_one_shot": OneShotReduce(largest, device),
        "lamport": LamportReduce(largest * 2, device, rank, size),
    }
    for tokens, hidden in SHAPES:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
        for name, method in methods.items():
            micros = _graph_time_us(torch, method, x)
            if rank == 0:
                print(
                    json.dumps(
                        {
                            "benchmark": "all_reduce",
                            "tp": size,
                            "method": name,
                            "tokens": tokens,
                            "hidden": hidden,
                            "bytes": x.numel() * 2,
                            "us_per_all_reduce": round(micros, 1),
                        }
                    ),
                    flush=True,
                )
    torch.distributed.destroy_process_group()


def _graph_time_us(torch, method, x) -> float:
    def chain():
        y = x.clone()
        for _ in range(REDUCES_PER_GRAPH):
            y = method.all_reduce(y)
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.distributed.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / REDUCES_PER_GRAPH)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--init-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args.rank, args.tp, args.init_file)
        return
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ranks = [
            subprocess.Popen(
                [sys.executable, __file__, "--tp", str(args.tp), "--rank", str(r), "--init-file", init_file]
            )
            for r in range(args.tp)
        ]
        codes = [p.wait() for p in ranks]
    if any(codes):
        sys.exit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()
