"""Tensor-parallel building blocks: each rank holds a slice of a weight and knows which part of
the checkpoint's full tensor fills it, so loading reads only that part from disk.

- ColumnParallelLinear: output rows split (fused q/k/v or gate/up: one span per fused part; the
  checkpoint holds the parts apart (Llama) or fused too (Phi-3), and each rank reads its rows of each).
- RowParallelLinear: input columns split; partial products are summed with an all-reduce.
- VocabParallelEmbedding / ParallelLMHead: vocabulary rows split in equal padded blocks; the
  embedding all-reduces the rows each rank found, the head gathers logits to rank 0.
At tp 1 every one of them computes exactly what nn.Linear / nn.Embedding would.

The linear layers hold their weights through a weights object (zllm/workers/linear_weights.py:
the model dtype or FP8), which creates the parameters, says where each checkpoint tensor lands
and multiplies; the layers only know the tensor-parallel geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zllm.partition import Span, padded_vocab_per_rank, vocab_shard
from zllm.quantization import QuantSpec
from zllm.workers.distributed import TensorParallel
from zllm.workers.linear_weights import (
    DenseWeights,
    FusedPart,
    LoadTarget,
    WeightRegion,
    check_block_aligned,
    weights_for,
    whole_tensor_target,
)
from zllm.workers.ops import gemv_takes_one_row, linear


class _Linear(nn.Module):
    """What both parallel linear layers share: the weights object and switching it off for a
    module the checkpoint leaves unquantized."""

    lora = None  # the adapter slots of this projection (zllm/workers/lora.py), with enable_lora

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The weights' product plus bias, and the rows' adapters where LoRA is on (which may add
        them in the same launch: LoRALayer.project)."""
        if self.lora is None:
            return self.weights.apply(self, x, bias)
        return self.lora.project(x, bias)

    def _build(self, rows: int, cols: int, num_parts: int, quant: QuantSpec | None) -> None:
        self.rows, self.cols, self.num_parts = rows, cols, num_parts
        self.weights = weights_for(quant)
        self.weights.create(self, rows, cols, num_parts)

    def use_dense_weights(self) -> None:
        for name in ("weight", "weight_scale", "weight_scale_inv", "input_scale"):
            if hasattr(self, name):
                delattr(self, name)
        self.weights = DenseWeights()
        self.weights.create(self, self.rows, self.cols, self.num_parts)

    def checkpoint_params(self) -> tuple[str, ...]:
        return self.weights.checkpoint_params()

    def finish_loading(self) -> None:
        self.weights.finish_loading(self)

    def _weight_target(self, param_name: str, region: WeightRegion) -> LoadTarget:
        return self.weights.load_target(self, param_name, region)

    def fold_norm(self, norm_weight: torch.Tensor) -> None:
        """weight's columns times an RMSNorm's weight (rounded once to the dtype), the norm before
        this layer, which then scales by 1: the norm-carrying step's GEMVs (act_and_mul_normed,
        rope_cache_normed) have no weight of their own. Model-dtype weights only."""
        if not isinstance(self.weights, DenseWeights):
            raise ValueError("fold_norm: only model-dtype weights take a norm's weight")
        self.weight.data.mul_(norm_weight.to(self.weight.dtype))


class ColumnParallelLinear(_Linear):
    def __init__(
        self,
        input_size: int,
        parts: list[FusedPart],
        bias: bool,
        quant: QuantSpec | None = None,
        fused_in_checkpoint: bool = False,
    ) -> None:
        """fused_in_checkpoint: one checkpoint tensor holds every part, one after the other
        (Phi-3's qkv_proj, gate_up_proj), and fills each shard from its own rows."""
        super().__init__()
        self.input_size = input_size
        self.parts = parts
        self.fused_in_checkpoint = fused_in_checkpoint
        rows = sum(p.span.count for p in parts)
        if quant is not None and quant.block:
            offset = 0
            for p in parts:
                check_block_aligned("fused part", offset, p.span.count, rows)
                check_block_aligned("column-parallel shard", p.span.start, p.span.count, p.full_rows)
                offset += p.span.count
        self._build(rows, input_size, len(parts), quant)
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x, self.bias)

    def act_and_mul(self, x: torch.Tensor, gelu: bool) -> torch.Tensor | None:
        """act(gate) * up of a gate_up layer (two parts of equal rows) in the product's own launch
        (Fp8Weights.apply_act_and_mul; silu, or gelu with the tanh approximation), or None where
        no such launch takes it: the caller then projects and activates, with the same bits."""
        if self.lora is not None or self.num_parts != 2 or self.parts[0].span.count != self.parts[1].span.count:
            return None
        return self.weights.apply_act_and_mul(self, x, self.bias, gelu)

    def rope_cache(self, x: torch.Tensor, rope) -> torch.Tensor | None:
        """The q/k/v product of one token with q and k rotated and k and v stored in the cache
        (rope: kernels.RopeCache) in the product's own launch, or None where no such launch takes
        it: the caller then projects, rotates and stores, with the same bits."""
        if self.lora is not None or self.num_parts != 3:
            return None
        return self.weights.apply_rope_cache(self, x, self.bias, rope)

    # The norm-carrying decode step (ZLLM_NORM_GEMV): x is a residual stream row and the product
    # is of its RMSNorm (eps; the norm's weight folded into this layer's), in the one launch;
    # None where it does not take it.
    def act_and_mul_normed(self, x: torch.Tensor, eps: float) -> torch.Tensor | None:
        """silu(gate) * up of rms_norm(x)'s product (DenseWeights.apply_act_and_mul_normed)."""
        if self.lora is not None or self.num_parts != 2 or self.parts[0].span.count != self.parts[1].span.count:
            return None
        if not isinstance(self.weights, DenseWeights):
            return None
        return self.weights.apply_act_and_mul_normed(self, x, self.bias, eps)

    def rope_cache_normed(self, x: torch.Tensor, rope, eps: float) -> torch.Tensor | None:
        """rope_cache of rms_norm(x) (DenseWeights.apply_rope_cache_normed)."""
        if self.lora is not None or self.num_parts != 3 or not isinstance(self.weights, DenseWeights):
            return None
        return self.weights.apply_rope_cache_normed(self, x, self.bias, rope, eps)

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        if shard is None:
            if len(self.parts) != 1:
                raise ValueError(f"a fused weight of {len(self.parts)} parts needs a shard index")
            shard = 0
        part = self.parts[shard]
        offset = sum(p.span.count for p in self.parts[:shard])
        rows, src_rows = slice(offset, offset + part.span.count), slice(part.span.start, part.span.stop)
        full_rows = part.full_rows
        if self.fused_in_checkpoint:  # the part's rows start after the earlier parts' in the tensor
            src_offset = sum(p.full_rows for p in self.parts[:shard])
            src_rows = slice(src_rows.start + src_offset, src_rows.stop + src_offset)
            full_rows = sum(p.full_rows for p in self.parts)
        if param_name == "bias":
            return LoadTarget(self.bias.data[rows], (full_rows,), (src_rows,))
        region = WeightRegion(rows, src_rows, slice(None), (full_rows, self.input_size), shard)
        return self._weight_target(param_name, region)


@dataclass(slots=True)
class PendingSum:
    """A row-parallel layer's partial product whose all-reduce is left to the add-RMSNorm after it,
    which runs both in one launch (ZLLM_ALLREDUCE_NORM: RMSNorm.forward in models/llama.py). Not a
    tensor, so a consumer that is not ready for it fails loudly instead of reading a partial sum."""

    partial: torch.Tensor
    tp: TensorParallel

    def resolve(self) -> torch.Tensor:
        """The sum over the ranks, as the layer would have returned it."""
        return self.tp.all_reduce(self.partial)


class RowParallelLinear(_Linear):
    def __init__(
        self,
        full_input_size: int,
        output_size: int,
        span: Span,
        bias: bool,
        tp: TensorParallel,
        reduce: bool = True,
        quant: QuantSpec | None = None,
    ) -> None:
        """reduce=False leaves this rank's partial product for the caller to sum with others in
        one all-reduce (an MoE block: its experts and shared expert)."""
        super().__init__()
        self.full_input_size = full_input_size
        self.span = span
        self.tp = tp
        self.reduce = reduce
        if bias and not reduce:
            raise ValueError("a bias needs the reduction: it is added once, after the partial sums")
        if quant is not None and quant.block:
            check_block_aligned("row-parallel shard", span.start, span.count, full_input_size)
        self._build(output_size, span.count, 1, quant)
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor, defer: bool = False) -> torch.Tensor | PendingSum:
        """defer: the caller norms the output next (add_rms_norm) and can take a PendingSum, which
        it gets where the fused all-reduce + add-RMSNorm kernel is set up (ZLLM_ALLREDUCE_NORM)."""
        if self.tp.size == 1 or not self.reduce:
            return self._project(x, self.bias)
        # LoRA's share of this rank's columns joins the partial product: one all-reduce sums both.
        partial = self._project(x, None)
        if defer and self.bias is None and self.tp.fast is not None and self.tp.fast.norm is not None:
            return PendingSum(partial, self.tp)
        out = self.tp.all_reduce(partial)
        # The bias is added once, after the partial sums are combined.
        return out if self.bias is None else out + self.bias

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + this layer's output: the residual stream after it (the norm-carrying decode
        step, ZLLM_NORM_GEMV). Where the all-reduce sums in fp32 (tp 1; the symmetric-memory
        path, which takes this row on every rank or on none), the first rank adds the residual
        and the bias to its partial product, in the GEMV's epilogue where DenseWeights.apply_add
        takes it, so the one all-reduce returns the new stream. NCCL sums in the dtype, step by
        step: there the residual is added once, after it, as the usual step adds it."""
        tp = self.tp
        if tp.size > 1 and (tp.fast is None or not tp.fast.accepts(residual)):
            out = tp.all_reduce(self._project(x, None))
            return (out if self.bias is None else out + self.bias) + residual
        if tp.size > 1 and self._pushes(x, residual):
            first = tp.is_first
            return tp.fast.gemv_all_reduce(x, self.weight, self.bias if first else None, residual if first else None)
        if not tp.is_first:
            return tp.all_reduce(self._project(x, None))
        out = None
        if self.lora is None and isinstance(self.weights, DenseWeights):
            out = self.weights.apply_add(self, x, self.bias, residual)
        if out is None:  # the product rounded to the dtype, then the add: the kernel's order
            out = self._project(x, self.bias) + residual
        return tp.all_reduce(out)

    def _pushes(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether add_to's GEMV pushes its rows into the Lamport buffers itself (ZLLM_GEMV_PUSH):
        a dense one-row bf16 product the b6 build takes, no LoRA; tp.fast is set (add_to checked).
        Shapes, dtypes and switches (the push's own agreed by every rank at set-up), so the ranks
        answer alike; the first rank's bias and residual do not count. A rank whose GEMV settings
        differed would only all-reduce its stored product instead: either way one Lamport launch
        a slot, the same sum."""
        return (
            self.lora is None
            and isinstance(self.weights, DenseWeights)
            and tuple(residual.shape) == (1, self.weight.shape[0])
            and residual.dtype == x.dtype
            and gemv_takes_one_row(x, self.weight)
            and self.tp.fast.takes_pushed(self.weight.shape[0], x.dtype)
        )

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        if param_name == "bias":
            return whole_tensor_target(self.bias)
        rows = self.weight.shape[0]
        region = WeightRegion(
            slice(0, rows), slice(None), slice(self.span.start, self.span.stop), (rows, self.full_input_size), 0
        )
        return self._weight_target(param_name, region)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.span = vocab_shard(vocab_size, tp.size, tp.rank)
        # Padding rows stay zero: their logits are cut off and no token id reaches them.
        self.weight = nn.Parameter(torch.zeros(padded_vocab_per_rank(vocab_size, tp.size), hidden_size))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        mine = (token_ids >= self.span.start) & (token_ids < self.span.stop)
        local_ids = torch.where(mine, token_ids - self.span.start, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(rows)

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        full_shape = (self.vocab_size, self.weight.shape[1])
        return LoadTarget(
            self.weight.data.narrow(0, 0, self.span.count), full_shape, (slice(self.span.start, self.span.stop),)
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0 (None elsewhere) with this module's weight as the head."""
        local = linear(hidden, self.weight)
        full = self.tp.gather_to_first(local)
        if full is None or full.shape[-1] == self.vocab_size:
            return full
        return full[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output projection, split like the embedding."""
