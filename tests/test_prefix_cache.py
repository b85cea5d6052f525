"""Prefix caching in the engine core: chained block hashes, the cache in the block pool (LRU
eviction through the free list), the KV cache manager's lookups, and the scheduler sharing
blocks between requests. A fake KV cache checks that no request ever reads a block holding
other tokens than its own (stale after eviction, or shared wrongly)."""

from __future__ import annotations

import random

import pytest

from tests.helpers.scheduler import EOS, add, assert_all_blocks_free, complete, make_scheduler, run_step
from zllm.block_hash import extend_block_hashes, hash_block
from zllm.enginecore.block_pool import BlockPool
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.request import Request
from zllm.ipc.messages import StepInput, StepOutput
from zllm.sampling_params import SamplingParams

BS = 4


def request_with(
    request_id: str, tokens: list[int], *, max_tokens: int = 4, salt: str | None = None, **sampling
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling=SamplingParams(temperature=0, max_tokens=max_tokens, **sampling),
        eos_token_ids=frozenset({EOS}),
        cache_salt=salt,
    )


def caching_scheduler(**kwargs):
    return make_scheduler(block_size=BS, enable_prefix_caching=True, **kwargs)


# ---- hashes ------------------------------------------------------------------------------------


def test_block_hash_depends_on_tokens_parent_and_salt():
    first = hash_block(None, [1, 2, 3, 4])
    assert first == hash_block(None, [1, 2, 3, 4])
    assert first != hash_block(None, [1, 2, 3, 5])
    assert first != hash_block(None, [1, 2, 3, 4], salt="tenant-a")
    assert hash_block(None, [1, 2, 3, 4], salt="a") != hash_block(None, [1, 2, 3, 4], salt="b")
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert len(first) == 32


def test_block_hashes_extend_incrementally_over_full_blocks_only():
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BS, None)
    assert len(hashes) == 2
    assert hashes[1] == hash_block(hash_block(None, tokens[:4]), tokens[4:8])
    extend_block_hashes(hashes, tokens + [10, 11], BS, None)
    assert len(hashes) == 3
    assert hashes[2] == hash_block(hashes[1], [8, 9, 10, 11])


# ---- the pool's cache --------------------------------------------------------------------------


def test_freed_cached_block_stays_findable_until_allocation_evicts_it_in_lru_order():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"hash-a")
    pool.cache(b, b"hash-b")
    pool.free([b, a])  # free list: [2, b, a]
    assert pool.cached_block(b"hash-a") is a and pool.num_cached_blocks == 2
    assert pool.num_free_blocks == 3

    (fresh,) = pool.allocate(1)
    assert fresh.block_id == 2 and pool.num_cached_blocks == 2
    assert pool.num_evictions == 0
    (evicted,) = pool.allocate(1)
    assert evicted is b and pool.num_evictions == 1
    assert pool.cached_block(b"hash-b") is None and b.block_hash is None
    assert pool.cached_block(b"hash-a") is a


def test_touch_revives_a_free_cached_block_and_shares_a_used_one():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    assert block.block_id not in pool._free.block_ids()


def test_a_second_block_with_the_same_hash_stays_private():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, b"h")
    pool.cache(second, b"h")
    assert pool.cached_block(b"h") is first and second.block_hash is None


def test_reset_forgets_every_hash():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h")
    assert pool.reset_prefix_cache() == 1
    assert pool.cached_block(b"h") is None and block.block_hash is None and pool.num_cached_blocks == 0


# ---- the manager ---------------------------------------------------------------------------------


def computed(manager: KVCacheManager, request: Request) -> None:
    """Allocate and register the whole request as if its prompt was computed."""
    assert manager.allocate_slots(request.request_id, request.num_tokens) is not None
    manager.cache_full_blocks(request, request.num_tokens)


def test_lookup_finds_the_longest_cached_run_of_leading_blocks():
    manager = KVCacheManager(BlockPool(16), BS)
    computed(manager, request_with("a", list(range(12)) + [99]))
    hits = manager.find_cached_prefix(request_with("b", list(range(8)) + [50, 51, 52, 53, 54]))
    assert [b.block_id for b in hits.blocks] == manager.block_ids("a")[:2]
    assert manager.find_cached_prefix(request_with("c", [7] + list(range(1, 13)))).blocks == []


def test_lookup_never_covers_the_last_token():
    manager = KVCacheManager(BlockPool(16), BS)
    computed(manager, request_with("a", list(range(8)) + [9]))
    assert (
        manager.find_cached_prefix(request_with("b", list(range(8)))).num_blocks == 1
    )  # 8 tokens: the 2nd block is recomputed
    assert manager.find_cached_prefix(request_with("c", list(range(9)))).num_blocks == 2


def test_lookup_is_off_when_caching_is_disabled_or_prompt_logprobs_are_wanted():
    manager = KVCacheManager(BlockPool(16), BS, enable_caching=False)
    computed(manager, request_with("a", list(range(9))))
    assert manager.pool.num_cached_blocks == 0
    assert manager.find_cached_prefix(request_with("b", list(range(9)))).blocks == []

    manager = KVCacheManager(BlockPool(16), BS)
    computed(manager, request_with("a", list(range(9))))
    assert manager.find_cached_prefix(request_with("b", list(range(9)), prompt_logprobs=1)).blocks == []


def test_salts_keep_prefixes_apart():
    manager = KVCacheManager(BlockPool(16), BS)
    computed(manager, request_with("a", list(range(9)), salt="tenant-a"))
    assert manager.find_cached_prefix(request_with("b", list(range(9)), salt="tenant-a")).num_blocks == 2
    assert manager.find_cached_prefix(request_with("c", list(range(9)), salt="tenant-b")).blocks == []
    assert manager.find_cached_prefix(request_with("d", list(range(9)))).blocks == []


def test_allocating_with_a_cached_prefix_shares_its_blocks():
    manager = KVCacheManager(BlockPool(6), BS)
    a = request_with("a", list(range(9)))
    computed(manager, a)
    b = request_with("b", list(range(8)) + [70, 71, 72])
    hits = manager.find_cached_prefix(b)
    new = manager.allocate_slots("b", b.num_tokens, hits)
    assert new[:2] == manager.block_ids("a")[:2] and len(new) == 3
    assert [blk.ref_cnt for blk in hits.blocks] == [2, 2]
    manager.free("a")
    assert [blk.ref_cnt for blk in hits.blocks] == [1, 1]
    manager.free("b")
    assert manager.pool.num_free_blocks == 6


def test_allocation_counts_revived_free_blocks_against_the_pool():
    manager = KVCacheManager(BlockPool(3), BS)
    a = request_with("a", list(range(9)))
    computed(manager, a)
    manager.free("a")  # 3 free blocks, two of them cached
    b = request_with("b", list(range(8)) + [1] * 8)
    hits = manager.find_cached_prefix(b)
    assert hits.num_blocks == 2
    assert manager.allocate_slots("b", b.num_tokens, hits) is None  # 2 revived + 2 new > 3 free
    assert [blk.ref_cnt for blk in hits.blocks] == [0, 0] and manager.pool.num_free_blocks == 3
    assert manager.block_ids("b") == []


# ---- the scheduler ----------------------------------------------------------------------------------


def test_a_later_request_starts_after_the_cached_prefix_of_an_earlier_one():
    scheduler = caching_scheduler()
    a = request_with("a", list(range(10)), max_tokens=1)
    add(scheduler, a)
    run_step(scheduler)
    assert not scheduler.has_unfinished_requests()

    b = request_with("b", list(range(8)) + [40, 41, 42])
    add(scheduler, b)
    step = scheduler.schedule()
    (new,) = step.new_requests
    assert new.num_computed_tokens == 8 and step.num_scheduled_tokens == [3]
    assert new.block_ids[:2] == [0, 1]  # a's blocks
    assert b.num_cached_tokens == 8
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_misses) == (10 + 11, 8, 13)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 21)
    deltas = complete(scheduler, step)
    assert deltas[0].num_cached_tokens == 8


def test_requests_admitted_in_the_same_step_share_the_blocks_computed_in_it():
    scheduler = caching_scheduler(max_num_batched_tokens=64)
    system = list(range(100, 116))
    add(scheduler, *(request_with(f"r{i}", system + [i, i + 1]) for i in range(3)))
    step = scheduler.schedule()
    assert [n.num_computed_tokens for n in step.new_requests] == [0, 16, 16]
    assert step.num_scheduled_tokens == [18, 2, 2]
    tables = [n.block_ids for n in step.new_requests]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert len({t[4] for t in tables}) == 3  # the partial last blocks are private


def test_a_chunked_prefill_shares_only_the_blocks_it_has_scheduled():
    scheduler = caching_scheduler(max_num_batched_tokens=8)
    add(scheduler, request_with("a", list(range(20))), request_with("b", list(range(20))))
    first = scheduler.schedule()
    assert scheduled_ids(first) == {"a": 8}
    complete(scheduler, first)
    second = scheduler.schedule()
    assert scheduled_ids(second) == {"a": 8}
    complete(scheduler, second)
    third = scheduler.schedule()
    # a finishes its prompt (4 tokens); b finds a's first 16 tokens cached and computes 4.
    assert scheduled_ids(third) == {"a": 4, "b": 4}
    assert third.new_requests[0].num_computed_tokens == 16


def scheduled_ids(step: StepInput) -> dict[str, int]:
    return dict(zip(step.scheduled_ids, step.num_scheduled_tokens))


def test_evicted_blocks_are_not_found_again():
    scheduler = caching_scheduler(num_blocks=6, max_model_len=32)
    a = request_with("a", list(range(9)), max_tokens=1)
    add(scheduler, a)
    run_step(scheduler)
    assert scheduler.kv_cache.pool.num_cached_blocks == 2
    # A request needing every block evicts a's cached ones.
    add(scheduler, request_with("big", [7] * 23, max_tokens=1))
    run_step(scheduler)
    b = request_with("b", list(range(9)))
    add(scheduler, b)
    step = scheduler.schedule()
    assert step.new_requests[0].num_computed_tokens == 0
    assert b.num_cached_tokens == 0


def test_reset_prefix_cache_makes_later_requests_recompute():
    scheduler = caching_scheduler()
    add(scheduler, request_with("a", list(range(9)), max_tokens=1))
    run_step(scheduler)
    assert scheduler.reset_prefix_cache() == 2
    assert scheduler.stats().num_cached_blocks == 0
    add(scheduler, request_with("b", list(range(9))))
    assert scheduler.schedule().new_requests[0].num_computed_tokens == 0


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    scheduler = caching_scheduler(num_blocks=5, max_num_batched_tokens=32)
    a, b = request_with("a", list(range(8)), max_tokens=8), request_with("b", [50 + i for i in range(7)], max_tokens=6)
    add(scheduler, a, b)
    run_step(scheduler)  # a: 2 blocks, b: 2 blocks
    run_step(scheduler)  # a needs a 3rd block: 5 in use
    step = scheduler.schedule()  # b needs a 3rd block too: preempted (the latest)
    assert step.preempted_ids == ["b"]
    complete(scheduler, step)
    step = scheduler.schedule()
    while "b" not in [n.request_id for n in step.new_requests]:
        complete(scheduler, step)
        step = scheduler.schedule()
    (resumed,) = step.new_requests
    assert resumed.num_computed_tokens >= BS  # at least its prompt's full block came back from the cache
    complete(scheduler, step)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert_all_blocks_free(scheduler)


# ---- a randomized workload against a fake KV cache ------------------------------------------------


class FakeKVCache:
    """The tokens each slot holds, written as the workers would write K/V. Every step checks that
    each scheduled request's table holds exactly its own tokens before the ones it computes."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (position, token)
        self.batch: dict[str, tuple[list[int], list[int], int]] = {}  # tokens, blocks, computed

    def execute(self, step: StepInput) -> list[str]:
        for request_id in (*step.finished_ids, *step.preempted_ids):
            del self.batch[request_id]
        for new in step.new_requests:
            self.batch[new.request_id] = (list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        for cached in step.cached_requests:
            tokens, blocks, _ = self.batch[cached.request_id]
            self.batch[cached.request_id] = (tokens, blocks + cached.new_block_ids, cached.num_computed_tokens)
        # Writes first (as every layer writes the batch's K/V before attention), then reads.
        for request_id, count in zip(step.scheduled_ids, step.num_scheduled_tokens):
            tokens, blocks, start = self.batch[request_id]
            for position in range(start, start + count):
                self.slots[self._slot(blocks, position)] = (position, tokens[position])
        sampling = []
        for request_id, count in zip(step.scheduled_ids, step.num_scheduled_tokens):
            tokens, blocks, start = self.batch[request_id]
            end = start + count
            for position in range(end):
                assert self.slots.get(self._slot(blocks, position)) == (position, tokens[position]), (
                    f"{request_id} reads a stale or foreign slot at position {position}"
                )
            self.batch[request_id] = (tokens, blocks, end)
            if end == len(tokens):
                sampling.append(request_id)
        return sampling

    def append_sampled(self, sampling: list[str], tokens: list[int]) -> None:
        """The workers append the tokens they sampled themselves (the core sends no token ids)."""
        for request_id, token in zip(sampling, tokens):
            if request_id in self.batch:
                self.batch[request_id][0].append(token)

    def _slot(self, blocks: list[int], position: int) -> tuple[int, int]:
        return blocks[position // self.block_size], position % self.block_size


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_shared_prefix_workload_never_reads_stale_blocks(policy):
    rng = random.Random(7)
    scheduler = caching_scheduler(
        num_blocks=24, max_model_len=48, max_num_seqs=6, max_num_batched_tokens=16, scheduling_policy=policy
    )
    kv = FakeKVCache(BS)
    systems = [[rng.randint(10, 99) for _ in range(rng.choice([4, 9, 16]))] for _ in range(3)]
    pending = []
    for i in range(120):
        prompt = rng.choice(systems) + [rng.randint(10, 99) for _ in range(rng.randint(1, 12))]
        request = request_with(f"r{i}", prompt, max_tokens=rng.randint(1, 12), salt=rng.choice([None, None, "s"]))
        request.priority = rng.randint(0, 3)
        pending.append(request)
    submitted = list(pending)
    for _ in range(5000):
        while pending and rng.random() < 0.4:
            scheduler.add_request(pending.pop(0))
        if not pending and not scheduler.has_unfinished_requests():
            break
        step = scheduler.schedule()
        sampling = kv.execute(step)
        if scheduler.requests and rng.random() < 0.02:
            scheduler.abort_requests([rng.choice(sorted(scheduler.requests))])
        tokens = [rng.randint(10, 99) for _ in sampling]
        kv.append_sampled(sampling, tokens)
        scheduler.update_from_output(StepOutput(step.step_id, sampling, tokens))
    else:
        pytest.fail("the workload did not finish")
    kv.execute(scheduler.schedule())
    assert_all_blocks_free(scheduler)
    assert all(b.ref_cnt == 0 for b in scheduler.kv_cache.pool.blocks)
    stats = scheduler.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert all(r.status.is_finished for r in submitted)
