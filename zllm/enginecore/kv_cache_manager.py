"""Per-request block tables on top of the block pool."""

from __future__ import annotations

from zllm.enginecore.block_pool import BlockPool, KVBlock


class KVCacheManager:
    """Maps each request to the blocks that hold its KV entries, in order."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._blocks: dict[str, list[KVBlock]] = {}

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_total_tokens`; return the new block ids,
        or None (allocating nothing) when the pool is short."""
        blocks = self._blocks.setdefault(request_id, [])
        missing = self.num_blocks_needed(num_total_tokens) - len(blocks)
        if missing <= 0:
            return []
        if missing > self.pool.num_free_blocks:
            return None
        new = self.pool.allocate(missing)
        blocks.extend(new)
        return [b.block_id for b in new]

    def free(self, request_id: str) -> None:
        # Freed in reverse so the tail blocks (least likely to be shared later) are reused first.
        blocks = self._blocks.pop(request_id, [])
        self.pool.free(reversed(blocks))
