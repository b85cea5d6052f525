"""Per-request block tables on top of the block pool, and automatic prefix caching.

A request's table is its blocks in token order. With caching on, each block that is full of
tokens about to be computed is registered under its chained hash (see block_hash), and a new
request starts with the longest run of its leading blocks already in the cache:

    request A:  [h0][h1][h2][partial]        cached: h0 h1 h2
    request B:  [h0][h1][h5][partial]        B reuses A's blocks for h0 h1, computes from token 32

The last token of a request is always computed (its logits are needed), so a hit never covers
all of its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zllm.block_hash import BlockHash, extend_block_hashes
from zllm.enginecore.block_pool import BlockPool, KVBlock
from zllm.enginecore.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens of the requests admitted (looked up in the cache)
    hits: int = 0  # of which were found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps each request to the blocks that hold its KV entries, in order."""

    def __init__(self, pool: BlockPool, block_size: int, enable_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.prefix_stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already cached

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def blocks(self, request_id: str) -> list[KVBlock]:
        return list(self._blocks.get(request_id, ()))

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of the request's leading full blocks that the cache holds."""
        if not self.enable_caching or request.sampling.prompt_logprobs is not None:
            return []  # prompt logprobs need the logits of every prompt position: compute them all
        hashes = self._block_hashes(request)
        hits = []
        for block_hash in hashes[: (request.num_tokens - 1) // self.block_size]:
            block = self.pool.cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that `num_tokens` tokens fill completely."""
        if not self.enable_caching:
            return
        blocks = self._blocks.get(request.request_id, [])
        hashes = self._block_hashes(request)
        first = self._num_registered.get(request.request_id, 0)
        last = min(num_tokens // self.block_size, len(blocks), len(hashes))
        for index in range(first, last):
            self.pool.cache(blocks[index], hashes[index])
        self._num_registered[request.request_id] = max(first, last)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.cache_salt)
        return request.block_hashes

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> list[int] | None:
        """Grow the request's table to cover `num_total_tokens`, starting a new table with
        `cached_prefix` (from find_cached_prefix); return the ids of the blocks added, or None
        (changing nothing) when the pool is short."""
        blocks = self._blocks.get(request_id, [])
        missing = self.num_blocks_needed(num_total_tokens) - len(blocks) - len(cached_prefix)
        # Reviving a free cached block takes it off the free list too.
        revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if max(missing, 0) + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(cached_prefix)
        new = list(cached_prefix) + (self.pool.allocate(missing) if missing > 0 else [])
        self._blocks.setdefault(request_id, []).extend(new)
        return [b.block_id for b in new]

    def free(self, request_id: str) -> None:
        # Freed in reverse so the tail blocks (least likely to be shared later) are evicted first.
        blocks = self._blocks.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        self.pool.free(reversed(blocks))
