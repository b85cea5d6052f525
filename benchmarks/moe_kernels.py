"""The fused MoE kernels (csrc/moe_kernels.cu: route, sort, gate_up + SiLU, down, weighted sum;
the sort-free GEMVs for a few tokens) on one MoE layer's shapes, against the torch expert loop
and the GPU's own limits measured in the same run (device-to-device copy bandwidth, a bf16
8192^3 matmul).

    python benchmarks/moe_kernels.py --shapes qwen3-30b-a3b mixtral-8x7b --batches 1 8 64 256 2048

For each batch size, LAYERS layers' worth of distinct expert weights (so L2 serves nothing across
calls) are called back to back in one CUDA graph and replayed under CUDA events. Random routing
(top k of Gaussian logits). Prints one JSON line per (shape, batch, method): microseconds per
layer, the bytes of the experts actually chosen read per microsecond (GB/s), and the tensor
FLOP rate of the useful products (2 * pairs * 3 * I * H).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.gpu_timing import graph_time_us
from zllm.workers.kernels import moe as fused
from zllm.workers.layers import moe_route
from zllm.workers.models.moe import expert_loop  # the reference loop (host syncs: timed eagerly)

SHAPES = {  # name -> (experts, top_k, hidden, expert intermediate), per layer at tp 1
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
WEIGHT_BYTES_PER_CASE = 5 << 30
REPLAYS = 10


def copy_bandwidth_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    micros = graph_time_us(lambda i: dst.copy_(src), 4, REPLAYS)
    return 2 * src.numel() / micros / 1e3


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    micros = graph_time_us(lambda i: torch.matmul(a, b, out=out), 4, REPLAYS)
    return 2 * 8192**3 / micros / 1e6


def eager_time_us(fn, calls: int) -> float:
    fn(0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def run_shape(name: str, batches: list[int], loop_batches: set[int]) -> None:
    experts, top_k, hidden, inter = SHAPES[name]
    layer_bytes = experts * 3 * inter * hidden * 2
    layers = max(2, WEIGHT_BYTES_PER_CASE // layer_bytes)
    gate_ups = [
        torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
        for _ in range(layers)
    ]
    downs = [
        torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5 for _ in range(layers)
    ]
    for batch in batches:
        x = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = moe_route(torch.randn(batch, experts, device="cuda"), top_k, True, True)
        ids32 = ids.to(torch.int32)
        chosen = ids.unique().numel()
        read = chosen * 3 * inter * hidden * 2
        flops = 2 * batch * top_k * 3 * inter * hidden
        methods = {"fused": lambda i: fused.fused_experts(x, weights, ids32, gate_ups[i], downs[i])}
        if batch <= 16:  # the sort-free GEMVs: each (token, slot) pair reads its expert
            for split, bound in fused.GEMV_BUILDS:
                methods[f"gemv-s{split}-{bound}"] = lambda i, split=split, bound=bound: fused.gemv_experts(
                    x, weights, ids32, gate_ups[i], downs[i], split=split, bound=bound
                )
        if fused.tile_rows(batch * top_k, experts) == 16:  # the 16-row tiles without split-K
            methods["fused-nosplit"] = lambda i: fused.fused_experts(
                x, weights, ids32, gate_ups[i], downs[i], variant="nosplit"
            )
        if fused.grouped_mm_available(x.device) and batch >= 8:
            methods["grouped-mm"] = lambda i: fused.grouped_mm_experts(x, weights, ids32, gate_ups[i], downs[i])
        if batch in loop_batches:
            methods["torch-loop"] = lambda i: expert_loop(x, weights, ids, gate_ups[i], downs[i])
        for method, fn in methods.items():
            micros = graph_time_us(fn, layers, REPLAYS) if method != "torch-loop" else eager_time_us(fn, layers)
            print(
                json.dumps(
                    {
                        "benchmark": "moe_kernels",
                        "shape": name,
                        "batch": batch,
                        "method": method,
                        "experts_chosen": chosen,
                        "tile_rows": fused.tile_rows(batch * top_k, experts),
                        "us_per_layer": round(micros, 1),
                        "chosen_weights_GBps": round(read / micros / 1e3, 1),
                        "TFLOPs": round(flops / micros / 1e6, 1),
                    }
                ),
                flush=True,
            )
    gate_ups = downs = None  # free the GPU memory before the next shape
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256, 2048])
    parser.add_argument("--loop-batches", nargs="*", type=int, default=[1, 256], help="also time the torch loop here")
    args = parser.parse_args()
    print(
        json.dumps(
            {
                "benchmark": "moe_kernels",
                "device": torch.cuda.get_device_name(),
                "copy_GBps": round(copy_bandwidth_gbps(), 1),
                "bf16_matmul_TFLOPs": round(matmul_tflops(), 1),
            }
        ),
        flush=True,
    )
    for name in args.shapes:
        run_shape(name, args.batches, set(args.loop_batches))


if __name__ == "__main__":
    main()
