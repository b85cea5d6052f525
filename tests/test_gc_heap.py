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
    assert frozen == gc.get_freeze_count() > len(keep)
    assert all(gc.is_tracked(item) for item in keep)
    # Frozen objects are in no generation a collection walks.
    walked = {id(obj) for generation in range(3) for obj in gc.get_objects(generation)}
    assert not any(id(item) in walked for item in keep)


def test_the_switch_turns_it_off(unfrozen, monkeypatch):
    monkeypatch.setenv("ZLLM_GC_FREEZE", "0")
    assert freeze_startup_heap("test") == 0
    assert gc.get_freeze_count() == 0


def test_heap_frozen_during_a_run_and_given_back_after(unfrozen):
    from zllm.procs.gc_heap import heap_frozen_during_run

    alive = [[i] for i in range(100)]
    with heap_frozen_during_run():
        assert gc.get_freeze_count() >= len(alive)
    assert gc.get_freeze_count() == 0  # an engine dropped after the run is collected again


def test_a_heap_frozen_already_is_left_alone(unfrozen):
    from zllm.procs.gc_heap import heap_frozen_during_run

    gc.freeze()
    before = gc.get_freeze_count()
    with heap_frozen_during_run():
        pass
    assert gc.get_freeze_count() == before  # the caller's freeze is not undone


def test_llm_generate_runs_with_the_heap_frozen(unfrozen, monkeypatch, tmp_path):
    """The offline loop (LLM.generate) steps with the start-up heap frozen, and gives it back."""
    from tests.helpers.models import save_tiny_llama
    from zllm import LLM, SamplingParams

    llm = LLM(str(save_tiny_llama(tmp_path / "tiny")), max_model_len=64)
    counts = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: counts.append(gc.get_freeze_count()) or step())
    llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert counts and min(counts) > 1000  # torch and the engine were out of the walks at every step
    assert gc.get_freeze_count() == 0
    llm.shutdown()
