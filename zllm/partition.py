"""How tensor parallelism splits a model across ranks: plain arithmetic, shared by the launcher
(which rejects impossible splits before anything starts) and the workers (which build their shard).

Heads are split in whole KV groups where there are at least as many KV heads as ranks, so every
rank keeps the same query-heads-per-KV-head ratio and the attention kernels need no special case.
With more ranks than KV heads, each KV head is replicated on the ranks that share its group and
the group's query heads are divided among them. Splits need not be even: SmolLM2's 9 heads run at
tp 2 as 6 + 3. A split is impossible only when some rank would get no query head.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Span:
    """A contiguous range [start, start + count) of some dimension."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The query and KV heads one rank owns (KV heads may be replicated on other ranks)."""

    q_heads: Span
    kv_heads: Span


def even_split(total: int, parts: int, index: int) -> Span:
    """Part `index` of `total` split into `parts` contiguous ranges whose sizes differ by <= 1."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return Span(start, base + (1 if index < extra else 0))


def vocab_shard(vocab_size: int, tp_size: int, rank: int) -> Span:
    """Rows of the embedding / LM head on `rank`: equal blocks of ceil(vocab / tp), the last one short.
    Equal padded blocks let rank 0 gather every rank's logits with one fixed-size collective."""
    per_rank = padded_vocab_per_rank(vocab_size, tp_size)
    start = min(rank * per_rank, vocab_size)
    return Span(start, min(per_rank, vocab_size - start))


def padded_vocab_per_rank(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


def head_shards(num_heads: int, num_kv_heads: int, tp_size: int) -> list[HeadShard]:
    """Every rank's heads; ValueError (naming tensor_parallel_size) when no valid split exists."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"model: {num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if tp_size > num_heads:
        raise ValueError(
            f"tensor_parallel_size: {tp_size} ranks exceed the model's {num_heads} attention heads "
            "(every rank needs at least one head)"
        )
    if tp_size <= num_kv_heads:
        shards = []
        for rank in range(tp_size):
            kv = even_split(num_kv_heads, tp_size, rank)
            shards.append(HeadShard(Span(kv.start * group, kv.count * group), kv))
        return shards
    return _replicated_kv_shards(num_kv_heads, group, tp_size)


def _replicated_kv_shards(num_kv_heads: int, group: int, tp_size: int) -> list[HeadShard]:
    shards = []
    for kv_head in range(num_kv_heads):
        # tp <= num_heads guarantees ranks_here <= group: every rank gets a query head.
        ranks_here = even_split(tp_size, num_kv_heads, kv_head).count
        for part in range(ranks_here):
            q = even_split(group, ranks_here, part)
            shards.append(HeadShard(Span(kv_head * group + q.start, q.count), Span(kv_head, 1)))
    return shards
