"""FP8 linear layers on the GPU: which way to multiply is fastest at which batch size.

For the Llama-3-8B projections (qkv, o, gate_up, down) and a range of token counts M, times
  bf16      F.linear on bf16 weights (the baseline)
  tensor    torch._scaled_mm, one scale for the activations and one for the weights
  rowwise   torch._scaled_mm, a scale per token (activation row) and per output channel
  block     the 128x128 block-scaled weight format, where this torch can multiply it
  quant     the cost of quantizing the activations per token with torch ops (what a fused kernel
            replaces)
  qscalar   csrc quant_fp8_rows, the scalar two-pass kernel
  qvec      csrc quant_fp8_rows, the one-pass vectorized kernel (what zllm runs)
with CUDA events over a CUDA graph of 20 calls, median of 5. Run on a GPU, from the repository root:
  python -m benchmarks.fp8_linear [--m 1,16,64,256,2048]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import graph_time_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0


def time_graph(fn, calls: int = 20, replays: int = 5) -> float:
    """Median µs of one call, `calls` of them captured in a CUDA graph."""
    return graph_time_us(lambda i: fn(), calls, replays)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3), scale


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="1,8,32,64,128,256,512,2048")
    parser.add_argument("--gemv-only", action="store_true", help="only the FP8 GEMV builds' table")
    parser.add_argument("--no-splits", action="store_true", help="the GEMV table without each split of the families")
    args = parser.parse_args()
    if args.gemv_only:
        _gemv_variants(not args.no_splits)
        return
    ms = [int(m) for m in args.m.split(",")]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    has_block = hasattr(torch.nn.functional, "scaled_mm") and hasattr(torch.nn.functional, "ScalingType")
    print(f"torch.nn.functional.scaled_mm with ScalingType: {has_block}")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, wscale = quantize_rows(w)
        wq_t = wq.t()  # _scaled_mm wants the second operand column-major
        w_tensor_scale = wscale.max().reshape(())
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xscale = quantize_rows(x)
            row = {"shape": name, "M": m, "bytes_fp8": n * k}
            row["bf16"] = time_graph(lambda: F.linear(x, w))
            row["tensor"] = time_graph(
                lambda: torch._scaled_mm(
                    xq, wq_t, scale_a=xscale.max().reshape(()), scale_b=w_tensor_scale, out_dtype=torch.bfloat16
                )
            )
            try:
                row["rowwise"] = time_graph(
                    lambda: torch._scaled_mm(
                        xq, wq_t, scale_a=xscale, scale_b=wscale.t().contiguous(), out_dtype=torch.bfloat16
                    )
                )
            except Exception as error:  # noqa: BLE001 - report what this torch refuses
                row["rowwise"] = float("nan")
                print(f"rowwise {name} M={m}: {type(error).__name__}: {error}"[:300])
            row["quant"] = time_graph(lambda: quantize_rows(x))
            row["qscalar"], row["qvec"] = (_time_csrc_quant(x, vectorized) for vectorized in (False, True))
            row["zllm"] = _time_zllm(x, wq, wscale)
            if has_block:
                row["block"] = _time_block(x, w, m, n, k)
            rows.append(row)
    keys = ["bf16", "tensor", "rowwise", "quant", "qscalar", "qvec", "zllm"] + (["block"] if has_block else [])
    print(f"{'shape':8} {'M':>5} " + " ".join(f"{key + ' µs':>11}" for key in keys) + f" {'zllm GB/s':>10}")
    for row in rows:
        gbps = row["bytes_fp8"] / (row["zllm"] * 1e3)
        print(f"{row['shape']:8} {row['M']:>5} " + " ".join(f"{row[key]:>11.1f}" for key in keys) + f" {gbps:>10.0f}")
    _gemv_variants(not args.no_splits)


def _time_zllm(x, wq, wscale) -> float:
    """zllm's fp8_linear as the model calls it: the csrc GEMV at M=1, else the csrc per-token
    quantization and row-wise cuBLASLt."""
    from zllm.workers.fp8 import fp8_linear

    scale = wscale.contiguous()
    return time_graph(lambda: fp8_linear(x, wq, scale, None, "token", False, None))


def _time_csrc_quant(x, vectorized: bool) -> float:
    from zllm.workers import kernels

    q = torch.empty(x.shape, dtype=E4M3, device=x.device)
    scales = torch.empty(x.shape[0], 1, device=x.device)
    return time_graph(lambda: kernels.quant_fp8_rows(q, scales, x, vectorized=vectorized))


def _gemv_variants(splits: bool = True) -> None:
    """GB/s of weight bytes at M=1 of every FP8 GEMV build (bf16, per-row scales): the default, the
    rows-per-warp shapes and issue 40's split and tensor-core families (each at the shape's
    default split and, with `splits`, at every split). Each call of the graph reads another copy
    of the weights, enough copies to pass 200 MB, so that the 50 MB L2 holds none of them when it
    is read again (the figures of qkv and o are otherwise the L2's). One row a build, and a JSON
    line each."""
    import json

    from zllm.workers import kernels
    from zllm.workers.kernels.matvec import fp8_gemv_variants

    variants = fp8_gemv_variants(with_splits=splits)
    table = {v: {} for v in variants}
    for name, (n, k) in SHAPES.items():
        copies = -(-200_000_000 // (n * k))
        weights = []
        for _ in range(copies):
            wq, wscale = quantize_rows(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            weights.append((wq, wscale.contiguous()))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        for v in variants:

            def call(i: int, v: str = v, w: list = weights) -> None:
                kernels.fp8_gemv(out, x, *w[i % len(w)], variant=v)

            table[v][name] = n * k / (graph_time_us(call, 4 * copies, 5) * 1e3)
        weights.clear()  # free this shape's copies before the next shape's
    print(f"{'FP8 GEMV build':22} " + " ".join(f"{name:>8}" for name in SHAPES) + "   GB/s (weights, no L2 reuse)")
    for v in variants:
        print(f"{v or 'default':22} " + " ".join(f"{table[v][name]:>8.0f}" for name in SHAPES))
    for v in variants:
        print(json.dumps({"fp8_gemv": v or "default", **{f"{name}_GBps": round(table[v][name]) for name in SHAPES}}))


def _time_block(x, w, m, n, k) -> float:
    """torch.nn.functional.scaled_mm with 1x128 activation and 128x128 weight block scales."""
    from torch.nn.functional import ScalingType, SwizzleType  # noqa: F401 - probe

    try:
        xg = x.view(m, k // 128, 128)
        xscale = xg.abs().amax(-1).float().clamp(min=1e-12) / FP8_MAX  # [m, k/128]
        xq = (xg / xscale[..., None]).to(E4M3).view(m, k)
        wb = w.view(n // 128, 128, k // 128, 128)
        wscale = wb.abs().amax(dim=(1, 3)).float() / FP8_MAX  # [n/128, k/128]
        wq = (wb / wscale[:, None, :, None]).to(E4M3).view(n, k)
        # cuBLASLt wants the activation scales column-major ([M, K/128] with strides (1, M)) and
        # the weight tiles' transposed; this is the layout zllm's quant_fp8_groups writes.
        xscale_t = torch.empty_strided((m, k // 128), (1, m), device="cuda")
        xscale_t.copy_(xscale)
        return time_graph(
            lambda: F.scaled_mm(
                xq,
                wq.t(),
                scale_a=xscale_t,
                scale_recipe_a=ScalingType.BlockWise1x128,
                scale_b=wscale.t(),
                scale_recipe_b=ScalingType.BlockWise128x128,
                output_dtype=torch.bfloat16,
            )
        )
    except Exception as error:  # noqa: BLE001 - report what this torch refuses
        print(f"block M={m}: {type(error).__name__}: {error}"[:300])
        return float("nan")


if __name__ == "__main__":
    main()
