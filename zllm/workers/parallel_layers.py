"""Tensor-parallel building blocks: each rank holds a slice of a weight and knows which part of
the checkpoint's full tensor fills it, so loading reads only that part from disk.

- ColumnParallelLinear: output rows split (fused q/k/v or gate/up: one span per fused part).
- RowParallelLinear: input columns split; partial products are summed with an all-reduce.
- VocabParallelEmbedding / ParallelLMHead: vocabulary rows split in equal padded blocks; the
  embedding all-reduces the rows each rank found, the head gathers logits to rank 0.
At tp 1 every one of them computes exactly what nn.Linear / nn.Embedding would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zllm.partition import Span, padded_vocab_per_rank, vocab_shard
from zllm.workers.distributed import TensorParallel
from zllm.workers.ops import linear


@dataclass(frozen=True, slots=True)
class LoadTarget:
    """Where one checkpoint tensor goes: `dest` is filled from `region` of a tensor of `full_shape`."""

    dest: torch.Tensor
    full_shape: tuple[int, ...]
    region: tuple[slice, ...]


@dataclass(frozen=True, slots=True)
class FusedPart:
    """One logical matrix inside a fused column-parallel weight: its full row count and this
    rank's rows of it."""

    full_rows: int
    span: Span


def whole_tensor_target(param: torch.Tensor) -> LoadTarget:
    """A replicated parameter (norms, biases after a reduction): every rank loads all of it."""
    return LoadTarget(param.data, tuple(param.shape), tuple(slice(None) for _ in param.shape))


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, parts: list[FusedPart], bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.parts = parts
        rows = sum(p.span.count for p in parts)
        self.weight = nn.Parameter(torch.empty(rows, input_size))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        if shard is None:
            if len(self.parts) != 1:
                raise ValueError(f"a fused weight of {len(self.parts)} parts needs a shard index")
            shard = 0
        part = self.parts[shard]
        offset = sum(p.span.count for p in self.parts[:shard])
        param = self.weight if param_name == "weight" else self.bias
        full_shape = (part.full_rows, self.input_size) if param_name == "weight" else (part.full_rows,)
        return LoadTarget(param.data.narrow(0, offset, part.span.count), full_shape, (slice(part.span.start, part.span.stop),))


class RowParallelLinear(nn.Module):
    def __init__(
        self, full_input_size: int, output_size: int, span: Span, bias: bool, tp: TensorParallel, reduce: bool = True
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
        self.weight = nn.Parameter(torch.empty(output_size, span.count))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1 or not self.reduce:
            return linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(linear(x, self.weight))
        # The bias is added once, after the partial sums are combined.
        return out if self.bias is None else out + self.bias

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        if param_name == "bias":
            return whole_tensor_target(self.bias)
        full_shape = (self.weight.shape[0], self.full_input_size)
        return LoadTarget(self.weight.data, full_shape, (slice(None), slice(self.span.start, self.span.stop)))


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
        return LoadTarget(self.weight.data.narrow(0, 0, self.span.count), full_shape, (slice(self.span.start, self.span.stop),))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0 (None elsewhere) with this module's weight as the head."""
        local = linear(hidden, self.weight)
        full = self.tp.gather_to_first(local)
        if full is None or full.shape[-1] == self.vocab_size:
            return full
        return full[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output projection, split like the embedding."""
