"""Does cuBLAS give the same bits for rows alone and for the same rows inside a padded batch?

Prints, per weight shape and dtype, the share of output elements of `F.linear(x[:m], w)` that
differ from `F.linear(x, w)[:m]`, for the (real, padded) row counts a piecewise step or a padded
decode graph sees. docs/architecture.md ("Which outputs are bit-stable") cites the result.
Usage, on a GPU:  python benchmarks/gpu/padded_gemm.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# (out, in) of the gqa-d128 test model's projections: qkv, o, gate_up, down.
WEIGHTS = [(1536, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]
ROWS = [(4, 16), (17, 32), (21, 32), (45, 48), (135, 160), (407, 448), (600, 640), (1000, 1024), (2000, 2048)]


def differing_shares(weight: torch.Tensor) -> list[str]:
    """For each (rows, padded) of ROWS: the share of the rows' outputs whose bits change when they
    are computed inside the padded batch."""
    shares = []
    for rows, padded in ROWS:
        x = torch.randn(padded, weight.shape[1], device="cuda", dtype=weight.dtype)
        alone, inside = F.linear(x[:rows], weight), F.linear(x, weight)[:rows]
        shares.append(f"{rows}/{padded}:{(alone != inside).float().mean().item():.3f}")
    return shares


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for dtype in (torch.bfloat16, torch.float32):
        for out_features, in_features in WEIGHTS:
            weight = torch.randn(out_features, in_features, device="cuda", dtype=dtype) * 0.05
            print(str(dtype).removeprefix("torch."), (out_features, in_features), " ".join(differing_shares(weight)))


if __name__ == "__main__":
    main()
