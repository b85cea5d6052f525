"""zllm/procs/gc_heap.py: the start-up heap frozen out of the collector's walks, and the switch."""

from __future__ import annotations

import gc

import pytest

from zllm.procs.gc_heap import freeze_startup_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # this test process keeps collecting everything it makes


def test_freeze_moves_every_live_object_out_of_the_walks(unfrozen):
    assert gc.get_freeze_count() == 0
    keep = [[i] for i in range(1000)]  # tracked objects alive at "start-up"
    frozen = freeze_startup_heap("test")
    # Frozen objects that die leave the count (another test's thread may free some meanwhile);
    # nothing but a freeze adds to it.
    assert frozen >= gc.get_freeze_count() > len(keep)
    assert all(gc.is_tracked(item) for item in keep)
    # Frozen objects are in no generation a collection walks.
    walked = {id(obj) for generation in range(3) for obj in gc.get_objects(generation)}
    assert not any(id(item) in walked for item in keep)


def test_the_switch_turns_it_off(unfrozen, monkeypatch):
    monkeypatch.setenv("ZLLM_GC_FREEZE", "0")
    assert freeze_startup_heap("test") == 0
    assert gc.get_freeze_count() == 0
