"""The KV block pool: fixed-size blocks, a free list with O(1) allocate and free, and the
prefix cache (block hash -> block).

The free list is threaded through the blocks themselves (prev/next links), so a block can also
leave it from the middle in O(1) — prefix caching needs that to revive a cached free block.

    head <-> b7 <-> b2 <-> b9 <-> tail      allocate pops from the head, free appends at the tail

A freed block keeps its hash and stays findable in the cache until allocation pops it from the
head for other tokens: the free list is also the LRU order of eviction.
"""

from __future__ import annotations

from collections.abc import Iterable

from zllm.block_hash import BlockHash


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "prev_free", "next_free", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.block_hash: BlockHash | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """A doubly linked list of free blocks with sentinels; every operation is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns every KV block; hands out and takes back whole blocks; maps hashes to cached blocks."""

    def __init__(self, num_blocks: int, reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"num_blocks: must be >= {1 + reserve_null_block}, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # A sliding-window group's tables point the entries behind the window at block 0, which
        # is never handed out (the workers keep it zero: a masked read of it is harmless).
        self.null_block = self.blocks[0] if reserve_null_block else None
        self._free = FreeBlockQueue(self.blocks[1:] if reserve_null_block else self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0  # cached blocks given to other tokens

    @property
    def num_blocks(self) -> int:
        """The blocks that can be handed out (the null block is not one)."""
        return len(self.blocks) - (self.null_block is not None)

    def owns(self, block: KVBlock) -> bool:
        return block.block_id < len(self.blocks) and self.blocks[block.block_id] is block

    @property
    def num_free_blocks(self) -> int:
        return self._free.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        if count > self.num_free_blocks:
            raise ValueError(f"cannot allocate {count} blocks: only {self.num_free_blocks} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self._free.append(block)

    # ---- prefix cache --------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks; a free one leaves the free list (no longer evictable)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Make a full, computed block findable by its hash. If another block already holds the
        same tokens, this one stays private (it is freed like any other)."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (blocks in use keep their contents); returns how many."""
        for block in self._cached.values():
            block.block_hash = None
        count = len(self._cached)
        self._cached.clear()
        return count

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Make blocks unfindable: their contents were never computed (the request that was to
        compute them failed on the workers)."""
        for block in blocks:
            self._forget_hash(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self._forget_hash(block)
            self.num_evictions += 1

    def _forget_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
