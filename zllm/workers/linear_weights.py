"""How a linear layer holds its weights: in the model dtype (`DenseWeights`) or in FP8 with
scales (`Fp8Weights`, arithmetic in zllm/workers/fp8.py). Each creates the layer's parameters,
says where a checkpoint tensor lands in this rank's slice (`WeightRegion`, given by the
tensor-parallel layer in zllm/workers/parallel_layers.py) and multiplies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zllm.partition import Span
from zllm.quantization import BLOCK, QuantSpec
from zllm.workers.fp8 import (
    E4M3,
    fp8_linear,
    fp8_linear_act_and_mul,
    fp8_linear_rope_cache,
    quantize_blocks,
    quantize_rows,
)
from zllm.workers.ops import (
    linear,
    linear_act_and_mul,
    linear_act_and_mul_normed,
    linear_add,
    linear_rope_cache,
    linear_rope_cache_normed,
)


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """Where one checkpoint tensor goes: `dest` is filled from `region` of a tensor of `full_shape`.

    full_shape None: the tensor is one value (a per-tensor scale, stored as [] or [1]). `store`,
    when set, takes the region's values instead of a plain copy into `dest` (quantizing them, or
    spreading one scale over rows)."""

    dest: torch.Tensor
    full_shape: tuple[int, ...] | None
    region: tuple[slice, ...]
    store: Callable[[torch.Tensor], None] | None = None

    def fill(self, values: torch.Tensor) -> None:
        if self.store is None:
            self.dest.copy_(values)
        else:
            self.store(values)


@dataclass(frozen=True, slots=True)
class FusedPart:
    """One logical matrix inside a fused column-parallel weight: its full row count and this
    rank's rows of it."""

    full_rows: int
    span: Span


@dataclass(frozen=True, slots=True)
class WeightRegion:
    """Rows `rows` of this rank's weight hold rows `src_rows` and columns `src_cols` of a
    checkpoint matrix of `full_shape`, fused part `part` of the layer."""

    rows: slice
    src_rows: slice
    src_cols: slice
    full_shape: tuple[int, int]
    part: int


def whole_tensor_target(param: torch.Tensor) -> LoadTarget:
    """A replicated parameter (norms, biases after a reduction): every rank loads all of it."""
    return LoadTarget(param.data, tuple(param.shape), tuple(slice(None) for _ in param.shape))


class DenseWeights:
    """Weights in the model dtype."""

    def create(self, layer: nn.Module, rows: int, cols: int, num_parts: int) -> None:
        layer.weight = nn.Parameter(torch.empty(rows, cols))

    def checkpoint_params(self) -> tuple[str, ...]:
        return ("weight", "bias")

    def finish_loading(self, layer: nn.Module) -> None:
        pass

    def load_target(self, layer: nn.Module, name: str, region: WeightRegion) -> LoadTarget:
        return LoadTarget(layer.weight.data[region.rows], region.full_shape, (region.src_rows, region.src_cols))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def apply_act_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, gelu: bool
    ) -> torch.Tensor | None:
        """act(gate) * up of a gate_up layer in one launch where linear_act_and_mul takes it, else None."""
        return linear_act_and_mul(x, layer.weight, bias, gelu)

    def apply_rope_cache(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, rope
    ) -> torch.Tensor | None:
        """The q/k/v product with the rotary + cache write in one launch where linear_rope_cache takes it, else None."""
        return linear_rope_cache(x, layer.weight, bias, rope)

    # The norm-carrying decode step's launches (ops.linear_add and the _normed ones): None where
    # they do not take the product; Fp8Weights has none of them (the step is not taken there).
    def apply_add(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, add: torch.Tensor
    ) -> torch.Tensor | None:
        return linear_add(x, layer.weight, bias, add)

    def apply_act_and_mul_normed(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, eps: float
    ) -> torch.Tensor | None:
        return linear_act_and_mul_normed(x, layer.weight, bias, eps)

    def apply_rope_cache_normed(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        rope,
        eps: float,
    ) -> torch.Tensor | None:
        return linear_rope_cache_normed(x, layer.weight, bias, rope, eps)


def weights_for(quant: QuantSpec | None) -> DenseWeights | Fp8Weights:
    return DenseWeights() if quant is None else Fp8Weights(quant)


class Fp8Weights:
    """FP8 E4M3 weights and fp32 scales (the layout is zllm/workers/fp8.py's)."""

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.scale_name = "weight_scale_inv" if spec.source == "fp8" else "weight_scale"

    def create(self, layer: nn.Module, rows: int, cols: int, num_parts: int) -> None:
        layer.weight = nn.Parameter(torch.empty(rows, cols, dtype=E4M3), requires_grad=False)
        if self.spec.block:
            scale = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK), dtype=torch.float32)
        else:
            scale = torch.empty(rows, 1, dtype=torch.float32)
        layer.register_parameter(self.scale_name, nn.Parameter(scale, requires_grad=False))
        if self.spec.activation == "tensor":
            layer.input_scale = nn.Parameter(torch.empty(num_parts, dtype=torch.float32), requires_grad=False)

    def checkpoint_params(self) -> tuple[str, ...]:
        """The layer's parameters a checkpoint provides (online quantization derives the scales)."""
        if not self.spec.serialized:
            return ("weight", "bias")
        return ("weight", self.scale_name, "input_scale", "bias")

    def finish_loading(self, layer: nn.Module) -> None:
        """The parts of a fused layer share one input, so they share one static input scale: the
        largest of theirs (a smaller one could overflow the other parts' activations), as vLLM does."""
        if self.spec.activation == "tensor":
            layer.input_scale_max = layer.input_scale.detach().amax().reshape(1, 1)

    def weight_scale(self, layer: nn.Module) -> torch.Tensor:
        return getattr(layer, self.scale_name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(
            x,
            layer.weight,
            self.weight_scale(layer),
            getattr(layer, "input_scale_max", None),
            self.spec.activation,
            self.spec.block,
            bias,
        )

    def apply_act_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, gelu: bool
    ) -> torch.Tensor | None:
        """act(gate) * up of a gate_up layer in one launch where fp8_linear_act_and_mul takes it, else None."""
        return fp8_linear_act_and_mul(x, layer.weight, self.weight_scale(layer), self.spec.block, bias, gelu)

    def apply_rope_cache(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, rope
    ) -> torch.Tensor | None:
        """The q/k/v product with the rotary + cache write in one launch where fp8_linear_rope_cache takes it, else None."""
        return fp8_linear_rope_cache(x, layer.weight, self.weight_scale(layer), self.spec.block, bias, rope)

    def load_target(self, layer: nn.Module, name: str, region: WeightRegion) -> LoadTarget:
        scale = self.weight_scale(layer).data
        if name == "weight":
            dest = layer.weight.data[region.rows]
            store = self._checked_copy(dest) if self.spec.serialized else self._quantizer(dest, scale, region)
            return LoadTarget(dest, region.full_shape, (region.src_rows, region.src_cols), store)
        if name == self.scale_name:
            if self.spec.block:
                rows, src_rows, src_cols = (_blocks(s) for s in (region.rows, region.src_rows, region.src_cols))
                full = tuple(-(-n // BLOCK) for n in region.full_shape)
                return LoadTarget(scale[rows], full, (src_rows, src_cols))
            dest = scale[region.rows]
            if self.spec.weight == "channel":
                return LoadTarget(dest, (region.full_shape[0], 1), (region.src_rows, slice(None)))
            return LoadTarget(dest, None, (), lambda value: dest.copy_(value.reshape(1, 1).expand_as(dest)))
        if name == "input_scale":
            dest = layer.input_scale.data[region.part : region.part + 1]
            return LoadTarget(dest, None, (), lambda value: dest.copy_(value.reshape(1)))
        raise ValueError(f"an FP8 linear layer has no parameter {name!r}")

    @staticmethod
    def _checked_copy(dest: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def store(values: torch.Tensor) -> None:
            if values.dtype != E4M3:
                raise ValueError(
                    f"expected float8_e4m3fn weights (the config's quantization_config), got {values.dtype}"
                )
            dest.copy_(values)

        return store

    def _quantizer(
        self, dest: torch.Tensor, scale: torch.Tensor, region: WeightRegion
    ) -> Callable[[torch.Tensor], None]:
        """Online quantization: the region's values (model dtype) become FP8 and their scales."""

        def store(values: torch.Tensor) -> None:
            values = values.to(dest.device)
            if self.spec.block:
                q, s = quantize_blocks(values)
                scale[_blocks(region.rows)].copy_(s)
            else:
                q, s = quantize_rows(values)
                scale[region.rows].copy_(s)
            dest.copy_(q)

        return store


def _blocks(rows: slice) -> slice:
    """The 128-blocks covering an aligned slice (the last may be partial)."""
    start = rows.start or 0
    return slice(start // BLOCK, None if rows.stop is None else -(-rows.stop // BLOCK))


def check_block_aligned(what: str, start: int, count: int, full: int) -> None:
    """Block-scaled weights split only on block boundaries (the last block may be partial)."""
    if start % BLOCK or (count % BLOCK and start + count != full):
        raise ValueError(
            f"{what}: rows/columns {start}..{start + count} of {full} do not fall on {BLOCK}-element block boundaries; "
            f"a block-quantized (128x128) checkpoint needs a tensor-parallel size that splits every projection on them"
        )
