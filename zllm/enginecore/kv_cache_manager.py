"""Per-request block tables on top of the block pool, and automatic prefix caching.

A request's table is its blocks in token order. With caching on, each block that is full of
tokens about to be computed is registered under its chained hash (see block_hash), and a new
request starts with the longest run of its leading blocks already in the cache:

    request A:  [h0][h1][h2][partial]        cached: h0 h1 h2
    request B:  [h0][h1][h5][partial]        B reuses A's blocks for h0 h1, computes from token 32

The last token of a request is always computed (its logits are needed), so a hit never covers
all of its tokens.

Sliding windows (zllm/kv_layout.py): a group of layers with a window needs only the blocks its
window reaches. Before each of a request's steps, the blocks wholly behind the window of the
step's first token go back to the pool (still findable by hash until evicted) and the table
points those entries at the pool's null block. A hybrid model (Gemma 2/3) has two groups, each
with its own pool and tables: group 0's block ids travel as `block_ids`, group 1's as
`sliding_block_ids`. A prefix hit needs every block of group 0 up to it, and in a window group
only the blocks the hit's window reaches.

    window 8, block 4, next token at 13:  [null][null][b2][b3]   keys 6..12 are still seen
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from zllm.block_hash import BlockHash, extend_block_hashes
from zllm.enginecore.block_pool import BlockPool, KVBlock
from zllm.enginecore.request import Request
from zllm.kv_layout import blocks_held


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens of the requests admitted (looked up in the cache)
    hits: int = 0  # of which were found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(slots=True)
class CachedPrefix:
    """A prefix hit: each group's leading table entries (a window group's null block where its
    window does not reach), all covering num_blocks blocks."""

    groups: list[list[KVBlock]] = field(default_factory=list)

    @property
    def blocks(self) -> list[KVBlock]:
        """Group 0's entries."""
        return self.groups[0] if self.groups else []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(slots=True)
class _Group:
    pool: BlockPool
    window: int | None
    tables: dict[str, list[KVBlock]] = field(default_factory=dict)
    first_live: dict[str, int] = field(default_factory=dict)  # entries before it point at the null block
    unsent: dict[str, list[int]] = field(default_factory=dict)  # group 1: ids the workers have not been told

    def is_null(self, block: KVBlock) -> bool:
        return block is self.pool.null_block


class KVCacheManager:
    """Maps each request to the blocks that hold its KV entries, in order, in each group."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_caching: bool = True,
        *,
        window: int | None = None,
        sliding_pool: BlockPool | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """pool: group 0's (every layer's, or a hybrid model's full layers'); window: group 0's
        window when every layer has one. sliding_pool / sliding_window: a hybrid model's group 1.
        A window group's pool must reserve its null block."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.prefix_stats = PrefixCacheStats()
        self._groups = [_Group(pool, window)]
        if sliding_pool is not None:
            self._groups.append(_Group(sliding_pool, sliding_window))
        for group in self._groups:
            if group.window is not None and group.pool.null_block is None:
                raise ValueError("a sliding-window group's pool must reserve a null block")
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already cached

    @property
    def pool(self) -> BlockPool:
        """Group 0's pool (the only one unless the model is hybrid)."""
        return self._groups[0].pool

    @property
    def pools(self) -> list[BlockPool]:
        return [g.pool for g in self._groups]

    @property
    def windows(self) -> list[int | None]:
        return [g.window for g in self._groups]

    @property
    def usage(self) -> float:
        """The fullest group's share of blocks in use."""
        return max(g.pool.usage for g in self._groups)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._groups[0].tables.get(request_id, ())]

    def take_sliding_block_ids(self, request_id: str) -> list[int]:
        """Group 1's whole table ([] unless the model is hybrid), for a request sent to the workers
        in full: nothing of it is new to them after this."""
        if len(self._groups) < 2:
            return []
        group = self._groups[1]
        group.unsent.pop(request_id, None)
        return [b.block_id for b in group.tables.get(request_id, ())]

    def take_new_sliding_block_ids(self, request_id: str) -> list[int]:
        """Group 1's ids added since the workers were last told."""
        return self._groups[1].unsent.pop(request_id, []) if len(self._groups) > 1 else []

    def blocks(self, request_id: str) -> list[KVBlock]:
        """Every real block the request holds, in every group (never a null block)."""
        return [b for g in self._groups for b in g.tables.get(request_id, ()) if not g.is_null(b)]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of the request's leading full blocks that every group holds (a
        window group: the blocks the run's window reaches)."""
        if not self.enable_caching or request.sampling.prompt_logprobs is not None:
            return CachedPrefix()  # prompt logprobs need the logits of every prompt position: compute them all
        hashes = self._block_hashes(request)[: (request.num_tokens - 1) // self.block_size]
        found = [[g.pool.cached_block(h) for h in hashes] for g in self._groups]
        count = len(hashes)
        for group, blocks in zip(self._groups, found):
            count = self._longest_hit(group, blocks, count)
        if count == 0:
            return CachedPrefix()
        return CachedPrefix([self._hit_entries(g, blocks, count) for g, blocks in zip(self._groups, found)])

    def _longest_hit(self, group: _Group, blocks: list[KVBlock | None], limit: int) -> int:
        """The most leading blocks, at most limit, a hit can cover in this group."""
        if group.window is None:
            return next((i for i, b in enumerate(blocks[:limit]) if b is None), limit)
        for count in range(limit, 0, -1):
            if all(b is not None for b in blocks[self._first_reached(group, count * self.block_size) : count]):
                return count
        return 0

    def _first_reached(self, group: _Group, position: int) -> int:
        """The first table entry the window of a token at `position` reaches (0 without a window)."""
        if group.window is None:
            return 0
        return max(0, position - group.window + 1) // self.block_size

    def _hit_entries(self, group: _Group, blocks: list[KVBlock | None], count: int) -> list[KVBlock]:
        first = self._first_reached(group, count * self.block_size)
        return [group.pool.null_block] * first + blocks[first:count]  # type: ignore[list-item]

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that `num_tokens` tokens fill completely."""
        if not self.enable_caching:
            return
        hashes = self._block_hashes(request)
        first = self._num_registered.get(request.request_id, 0)
        # Every group's table has the same length (allocate_slots grows them together).
        length = len(self._groups[0].tables.get(request.request_id, []))
        last = min(num_tokens // self.block_size, length, len(hashes))
        for group in self._groups:
            blocks = group.tables.get(request.request_id, [])
            for index in range(first, last):
                if not group.is_null(blocks[index]):
                    group.pool.cache(blocks[index], hashes[index])
        self._num_registered[request.request_id] = max(first, last)

    def reset_prefix_cache(self) -> int:
        return sum(g.pool.reset_prefix_cache() for g in self._groups)

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Forget the hashes of these blocks, whichever group's they are."""
        blocks = list(blocks)
        for group in self._groups:
            group.pool.uncache(b for b in blocks if group.pool.owns(b))

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.cache_salt,
            request.image_spans,
            request.lora_id,
        )
        return request.block_hashes

    # ---- allocation ----------------------------------------------------------------------------

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> list[tuple[int, int]]:
        """(blocks one sequence of num_tokens holds at most, blocks the pool has) per group; a step
        computes at most max_chunk tokens of it."""
        return [
            (blocks_held(num_tokens, g.window, self.block_size, max_chunk), g.pool.num_blocks) for g in self._groups
        ]

    def free_out_of_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks no window reaches any more: the next token computed is at
        num_computed_tokens, and its window starts window - 1 tokens before it."""
        for group in self._groups:
            table = group.tables.get(request_id)
            if group.window is None or not table:
                continue
            first = min(self._first_reached(group, num_computed_tokens), len(table))
            for index in range(group.first_live.get(request_id, 0), first):
                if not group.is_null(table[index]):
                    group.pool.free([table[index]])
                    table[index] = group.pool.null_block  # type: ignore[assignment]
            group.first_live[request_id] = max(first, group.first_live.get(request_id, 0))

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, cached_prefix: CachedPrefix | None = None
    ) -> list[int] | None:
        """Grow the request's tables to cover `num_total_tokens`, starting new tables with
        `cached_prefix` (from find_cached_prefix); return the ids added to group 0's table, or
        None (changing nothing) when a pool is short. Group 1's new ids wait in
        take_new_sliding_block_ids."""
        prefixes = cached_prefix.groups if cached_prefix is not None and cached_prefix.groups else None
        plans = []
        for index, group in enumerate(self._groups):
            prefix = prefixes[index] if prefixes else []
            blocks = group.tables.get(request_id, [])
            missing = self.num_blocks_needed(num_total_tokens) - len(blocks) - len(prefix)
            # Reviving a free cached block takes it off the free list too.
            revived = sum(1 for b in prefix if b.ref_cnt == 0 and not group.is_null(b))
            if max(missing, 0) + revived > group.pool.num_free_blocks:
                return None
            plans.append((group, prefix, missing))
        new_ids = []
        for index, (group, prefix, missing) in enumerate(plans):
            real = [b for b in prefix if not group.is_null(b)]
            group.pool.touch(real)
            if prefix and group.window is not None:
                group.first_live[request_id] = len(prefix) - len(real)
            new = list(prefix) + (group.pool.allocate(missing) if missing > 0 else [])
            group.tables.setdefault(request_id, []).extend(new)
            ids = [b.block_id for b in new]
            if index == 0:
                new_ids = ids
            else:
                group.unsent.setdefault(request_id, []).extend(ids)
        return new_ids

    def free(self, request_id: str) -> None:
        # Freed in reverse so the tail blocks (least likely to be shared later) are evicted first.
        self._num_registered.pop(request_id, None)
        for group in self._groups:
            blocks = group.tables.pop(request_id, [])
            group.first_live.pop(request_id, None)
            group.unsent.pop(request_id, None)
            group.pool.free(b for b in reversed(blocks) if not group.is_null(b))
