"""BlockPool, its linked free list, and the per-request block tables of KVCacheManager."""

from __future__ import annotations

import random

import pytest

from zllm.enginecore.block_pool import BlockPool, FreeBlockQueue, KVBlock
from zllm.enginecore.kv_cache_manager import KVCacheManager


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def make_queue(n: int) -> tuple[FreeBlockQueue, list[KVBlock]]:
    blocks = [KVBlock(i) for i in range(n)]
    return FreeBlockQueue(blocks), blocks


def walk(start: KVBlock, end: KVBlock, link: str, limit: int) -> list[int]:
    """The block ids from `start` to `end` following `link`; fails instead of looping on a cycle."""
    ids, block = [], getattr(start, link)
    while block is not end:
        assert block is not None and len(ids) < limit, "broken free list"
        ids.append(block.block_id)
        block = getattr(block, link)
    return ids


def assert_links_consistent(queue: FreeBlockQueue, num_blocks: int) -> list[int]:
    """Walking forward and backward visits the same blocks, and num_free counts them."""
    forward = walk(queue._head, queue._tail, "next_free", num_blocks)
    backward = walk(queue._tail, queue._head, "prev_free", num_blocks)
    assert backward == forward[::-1]
    assert queue.num_free == len(forward)
    return forward


# ---- FreeBlockQueue ---------------------------------------------------------------------------


def test_queue_starts_with_blocks_in_given_order():
    queue, _ = make_queue(5)
    assert queue.block_ids() == [0, 1, 2, 3, 4]
    assert queue.num_free == 5
    assert_links_consistent(queue, 5)


def test_popleft_takes_head_and_append_adds_at_tail():
    queue, blocks = make_queue(4)
    first = queue.popleft()
    assert first is blocks[0]
    assert first.prev_free is None and first.next_free is None
    queue.append(first)
    assert queue.block_ids() == [1, 2, 3, 0]
    assert_links_consistent(queue, 5)


@pytest.mark.parametrize("victim", [0, 2, 4])
def test_remove_from_any_position_keeps_links_valid(victim):
    queue, blocks = make_queue(5)
    queue.remove(blocks[victim])
    expected = [i for i in range(5) if i != victim]
    assert queue.block_ids() == expected
    assert blocks[victim].prev_free is None and blocks[victim].next_free is None
    assert_links_consistent(queue, 5)

    queue.append(blocks[victim])
    assert queue.block_ids() == expected + [victim]
    assert_links_consistent(queue, 5)
    assert [queue.popleft().block_id for _ in range(5)] == expected + [victim]


def test_remove_middle_relinks_neighbours():
    queue, blocks = make_queue(3)
    queue.remove(blocks[1])
    assert blocks[0].next_free is blocks[2]
    assert blocks[2].prev_free is blocks[0]


def test_removing_a_block_that_is_not_free_asserts():
    queue, blocks = make_queue(2)
    queue.popleft()
    with pytest.raises(AssertionError):
        queue.remove(blocks[0])
    assert queue.block_ids() == [1]


def test_popleft_on_empty_queue_raises_index_error():
    queue, _ = make_queue(1)
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    assert queue.num_free == 0
    assert queue.block_ids() == []


# ---- BlockPool --------------------------------------------------------------------------------


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_pops_from_head_and_sets_ref_count():
    pool = BlockPool(6)
    blocks = pool.allocate(2)
    assert ids(blocks) == [0, 1]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool._free.block_ids() == [2, 3, 4, 5]
    assert pool.num_free_blocks == 4


def test_freed_blocks_go_to_tail_and_are_reused_last():
    pool = BlockPool(4)
    first = pool.allocate(2)
    pool.free(first)
    assert pool._free.block_ids() == [2, 3, 0, 1]
    assert all(b.ref_cnt == 0 for b in first)
    assert ids(pool.allocate(3)) == [2, 3, 0]


def test_allocate_zero_returns_nothing():
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 3


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    free_before = pool._free.block_ids()
    ref_counts_before = [b.ref_cnt for b in pool.blocks]
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool._free.block_ids() == free_before
    assert [b.ref_cnt for b in pool.blocks] == ref_counts_before
    assert pool.num_free_blocks == 1


def test_double_free_is_caught():
    pool = BlockPool(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(blocks)
    assert pool.num_free_blocks == 3
    assert pool._free.block_ids().count(blocks[0].block_id) == 1


def test_double_free_within_one_call_is_caught():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([block, block])
    assert pool.num_free_blocks == 3


def test_usage_is_fraction_of_blocks_in_use():
    pool = BlockPool(4)
    assert pool.usage == 0.0
    one = pool.allocate(1)
    assert pool.usage == pytest.approx(0.25)
    rest = pool.allocate(3)
    assert pool.usage == pytest.approx(1.0)
    pool.free(one + rest)
    assert pool.usage == 0.0


# ---- KVCacheManager ---------------------------------------------------------------------------


def make_manager(num_blocks: int = 8, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), block_size)


@pytest.mark.parametrize(("num_tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_num_blocks_needed_rounds_up(num_tokens, blocks):
    assert make_manager(block_size=4).num_blocks_needed(num_tokens) == blocks


def test_allocate_slots_only_adds_missing_blocks():
    manager = make_manager()
    assert manager.allocate_slots("a", 3) == [0]
    assert manager.allocate_slots("a", 4) == []
    assert manager.allocate_slots("a", 9) == [1, 2]
    assert manager.allocate_slots("a", 2) == []
    assert manager.block_ids("a") == [0, 1, 2]
    assert manager.pool.num_free_blocks == 5


def test_block_ids_keep_allocation_order_per_request():
    manager = make_manager()
    manager.allocate_slots("a", 4)
    manager.allocate_slots("b", 4)
    manager.allocate_slots("a", 8)
    assert manager.block_ids("a") == [0, 2]
    assert manager.block_ids("b") == [1]
    assert manager.block_ids("unknown") == []


def test_allocate_slots_when_short_returns_none_and_allocates_nothing():
    manager = make_manager(num_blocks=3)
    manager.allocate_slots("a", 4)
    free_before = manager.pool._free.block_ids()
    assert manager.allocate_slots("b", 12) is None
    assert manager.allocate_slots("a", 16) is None
    assert manager.block_ids("a") == [0]
    assert manager.block_ids("b") == []
    assert manager.pool._free.block_ids() == free_before


def test_free_returns_blocks_in_reverse_order_to_the_tail():
    manager = make_manager(num_blocks=5)
    manager.allocate_slots("a", 12)
    manager.free("a")
    assert manager.block_ids("a") == []
    assert manager.pool._free.block_ids() == [3, 4, 2, 1, 0]
    assert manager.pool.num_free_blocks == 5


def test_free_of_unknown_or_already_freed_request_is_a_no_op():
    manager = make_manager(num_blocks=2)
    manager.allocate_slots("a", 4)
    manager.free("a")
    manager.free("a")
    manager.free("never-seen")
    assert manager.pool.num_free_blocks == 2


def test_random_allocate_and_free_never_leaks_blocks():
    rng = random.Random(20240601)
    num_blocks, block_size = 32, 4
    manager = make_manager(num_blocks, block_size)
    requests = [f"r{i}" for i in range(6)]
    tokens = dict.fromkeys(requests, 0)

    for _ in range(3000):
        request_id = rng.choice(requests)
        if rng.random() < 0.2:
            manager.free(request_id)
            tokens[request_id] = 0
        else:
            wanted = tokens[request_id] + rng.randint(1, 10)
            held_before = manager.block_ids(request_id)
            new = manager.allocate_slots(request_id, wanted)
            if new is None:
                assert manager.block_ids(request_id) == held_before
            else:
                assert manager.block_ids(request_id) == held_before + new
                tokens[request_id] = wanted

        held = [b for r in requests for b in manager.block_ids(r)]
        assert len(held) == len(set(held))
        assert not set(held) & set(assert_links_consistent(manager.pool._free, num_blocks))
        assert len(held) + manager.pool.num_free_blocks == num_blocks
        for r in requests:
            assert len(manager.block_ids(r)) == manager.num_blocks_needed(tokens[r])

    for r in requests:
        manager.free(r)
    assert manager.pool.num_free_blocks == num_blocks
    assert sorted(manager.pool._free.block_ids()) == list(range(num_blocks))
    assert all(b.ref_cnt == 0 for b in manager.pool.blocks)
    assert_links_consistent(manager.pool._free, num_blocks)
