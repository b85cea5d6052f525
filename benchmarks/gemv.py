"""One-token GEMV: zllm's csrc kernels (one warp a row, and the split builds) vs cuBLAS through
F.linear, on the projections of a batch-1 decode step, with the weight bytes streamed per
microsecond.

    python benchmarks/gemv.py --shapes llama3-8b
    python benchmarks/gemv.py --shapes llama3-8b --rows [--variants]

Each case is CALLS calls captured in one CUDA graph (different weight matrices, so nothing is
served from L2), replayed under CUDA events; prints one JSON line per (shape, method).

--rows: M = 1, 2, 4, 5, 8 rows of x (a small decode batch; a verifying step's 1 + 4 tokens, and
the 8 its decode graph pads them to) through zllm's kernel (gemv for M = 1, gemv_rows above) and
cuBLAS; then one summary line a projection with each method's time at M over its time at M = 1.
--variants adds every gemv_rows build. Loads only the GEMV module, and starts no case after
--budget-s seconds (default 50), so a run stays under a minute.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.gpu_timing import graph_time_us
from zllm.workers import kernels
from zllm.workers.kernels import loader, matvec

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
    # One rank's projections at tp 4 (issue 30: the shard's step runs at 75% of an H200's bandwidth)
    "llama3-70b-tp4": [
        ("qkv", 2560, 8192),
        ("o", 8192, 2048),
        ("gate_up", 14336, 8192),
        ("down", 8192, 7168),
        ("lm_head", 32064, 8192),
    ],
}
CALLS, REPLAYS = 16, 10
# "": one warp a row; "b<B>": split over gemv_split's warps, __launch_bounds__ minimum blocks B;
# "s<S>_b<B>": S warps a row (zllm.workers.kernels.matvec.gemv's variant).
VARIANTS = ["", "b0", "b4", "b6", "s2_b4", "s4_b4", "s4_b6"]


ROW_COUNTS = (1, 2, 4, 5, 8)
ROW_VARIANTS = [f"mma_g{g}_s{s}" for g in matvec.GEMV_ROWS_GROUPS for s in matvec.GEMV_ROWS_SPLITS] + ["fma"]


def rows_main(shapes: str, variants: bool, budget_s: float) -> None:
    """The --rows mode: M rows of x for each M of ROW_COUNTS, zllm vs cuBLAS (bf16)."""
    device = torch.device("cuda", torch.cuda.current_device())
    loaded = time.monotonic()
    origin = loader.load_module("gemv_kernels", device.index).origin  # NVRTC: compiled now, outside the budget
    print(json.dumps({"benchmark": "gemv_rows_load", "origin": origin, "seconds": round(time.monotonic() - loaded, 1)}))
    start = time.monotonic()
    for label, n, k in SHAPES[shapes]:
        if time.monotonic() - start > budget_s:
            print(json.dumps({"benchmark": "gemv_rows", "skipped": label, "reason": f"past {budget_s} s"}), flush=True)
            continue
        calls = max(2, min(CALLS, (6 << 30) // (n * k * 2)))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(calls)]
        x = torch.randn(max(ROW_COUNTS), k, device=device, dtype=torch.bfloat16)
        times: dict[str, dict[int, float]] = {}
        for m in ROW_COUNTS:
            xm = x[:m]
            outs = [torch.empty(m, n, device=device, dtype=torch.bfloat16) for _ in range(calls)]
            methods = {"cublas": lambda i, xm=xm, outs=outs: torch.matmul(xm, weights[i].t(), out=outs[i])}
            if m == 1:
                methods["zllm"] = lambda i, xm=xm, outs=outs: kernels.gemv(outs[i], xm, weights[i])
            else:
                methods["zllm"] = lambda i, xm=xm, outs=outs: kernels.gemv_rows(outs[i], xm, weights[i])
                for variant in ROW_VARIANTS if variants else []:
                    methods[f"zllm-{variant}"] = lambda i, xm=xm, outs=outs, v=variant: kernels.gemv_rows(
                        outs[i], xm, weights[i], variant=v
                    )
            for name, fn in methods.items():
                micros = graph_time_us(fn, calls, REPLAYS)
                times.setdefault(name, {})[m] = micros
                kernel = ""
                if name.startswith("zllm") and m > 1:
                    variant = name.partition("-")[2] or matvec.GEMV_ROWS_VARIANT
                    kernel = matvec.gemv_rows_kernel("bf16", m, n, k, variant)[0]
                line = {"benchmark": "gemv_rows", "shapes": shapes, "proj": label, "n": n, "k": k, "m": m}
                line |= {"method": name, "kernel": kernel, "us": round(micros, 2)}
                line["weight_GBps"] = round(n * k * 2 / micros / 1e3, 1)
                print(json.dumps(line), flush=True)
            outs = None
        base = times["zllm"][1]  # each method against the one-row GEMV, the batch-1 step's kernel
        summary = {"benchmark": "gemv_rows_summary", "shapes": shapes, "proj": label, "n": n, "k": k}
        summary["zllm_m1_us"] = round(base, 2)
        summary["over_zllm_m1"] = {
            name: {str(m): round(us / base, 3) for m, us in by_m.items()} for name, by_m in times.items()
        }
        print(json.dumps(summary), flush=True)
        weights = x = None  # free the GPU memory before the next shape
        torch.cuda.empty_cache()
    print(json.dumps({"benchmark": "gemv_rows_done", "seconds": round(time.monotonic() - start, 1)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--rows", action="store_true", help="M = 1, 2, 4, 5, 8 rows: gemv / gemv_rows vs cuBLAS")
    parser.add_argument("--variants", action="store_true", help="with --rows: every gemv_rows build too")
    parser.add_argument("--budget-s", type=float, default=50.0, help="with --rows: start no projection after this")
    args = parser.parse_args()
    if args.rows:
        rows_main(args.shapes, args.variants, args.budget_s)
        return
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
