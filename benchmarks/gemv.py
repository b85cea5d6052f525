"""One-token GEMV: zllm's csrc kernels (one warp a row, and the split builds) vs cuBLAS through
F.linear, on the projections of a batch-1 decode step, with the weight bytes streamed per
microsecond.

    python benchmarks/gemv.py --shapes llama3-8b

Each case is CALLS calls captured in one CUDA graph (different weight matrices, so nothing is
served from L2), replayed under CUDA events; prints one JSON line per (shape, method).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.gpu_timing import graph_time_us
from zllm.workers import kernels

SHAPES = {  # name -> [(label, N, K)] per rank
    "llama3-8b": [
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("lm_head", 128256, 4096),
    ],
    "qwen3-30b-a3b": [("qkv", 5120, 2048), ("o", 2048, 4096), ("router", 128, 2048), ("lm_head", 151936, 2048)],
    "llama3-70b-tp2": [
        ("qkv", 5120, 8192),
        ("o", 8192, 4096),
        ("gate_up", 28672, 8192),
        ("down", 8192, 14336),
        ("lm_head", 64128, 8192),
    ],
}
CALLS, REPLAYS = 16, 10
# "": one warp a row; "b<B>": split over gemv_split's warps, __launch_bounds__ minimum blocks B;
# "s<S>_b<B>": S warps a row (zllm.workers.kernels.matvec.gemv's variant).
VARIANTS = ["", "b0", "b4", "b6", "s2_b4", "s4_b4", "s4_b6"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama3-8b")
    args = parser.parse_args()
    device = torch.device("cuda")
    kernels.preload()
    for label, n, k in SHAPES[args.shapes]:
        calls = max(2, min(CALLS, (6 << 30) // (n * k * 2)))  # at most ~6 GiB of weights
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(calls)]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        outs = [torch.empty(1, n, device=device, dtype=torch.bfloat16) for _ in range(calls)]
        methods = {"cublas": lambda i: torch.matmul(x, weights[i].t(), out=outs[i])}
        for variant in VARIANTS:
            methods[f"zllm{'-' + variant if variant else ''}"] = lambda i, variant=variant: kernels.gemv(
                outs[i], x, weights[i], variant=variant
            )
        for name, fn in methods.items():
            micros = graph_time_us(fn, calls, REPLAYS)
            print(
                json.dumps(
                    {
                        "benchmark": "gemv",
                        "shapes": args.shapes,
                        "proj": label,
                        "n": n,
                        "k": k,
                        "method": name,
                        "us": round(micros, 2),
                        "weight_TBps": round(n * k * 2 / micros / 1e6, 3),
                    }
                ),
                flush=True,
            )
        weights = outs = None  # free the GPU memory before the next shape
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
