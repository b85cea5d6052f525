"""zllm/procs/gc_heap.py: the start-up heap frozen out of the collector's walks, and the switch."""

from __future__ import annotations

import gc
import weakref

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


@pytest.fixture
def as_on_cuda(monkeypatch):
    """The LLM's freeze as on a GPU (where it applies), over a CPU engine."""
    import zllm.launch.llm as llm_module

    monkeypatch.setattr(llm_module, "runs_on_cuda", lambda config: True)


def test_the_offline_llm_freezes_its_heap_and_thaws_it_when_it_shuts_down(unfrozen, as_on_cuda, tmp_path):
    from tests.helpers.models import save_tiny_llama
    from zllm import LLM, SamplingParams

    llm = LLM(str(save_tiny_llama(tmp_path / "tiny")), dtype="float32", max_model_len=64)
    # The engine (core and worker in this process) started, then everything alive was frozen.
    runner = llm.engine.core.executor.runner
    assert gc.get_freeze_count() > 0
    walked = {id(obj) for generation in range(3) for obj in gc.get_objects(generation)}
    assert id(runner) not in walked and id(runner.model) not in walked
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 4  # generation is unaffected
    # A model caught in a reference cycle must still be freed once the engine is gone.
    model = runner.model
    model.cycle = model  # a cycle only the collector can break
    survivor = weakref.ref(model)
    del model, runner
    llm.shutdown()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert survivor() is None


def test_the_offline_llm_leaves_the_heap_alone_when_switched_off(unfrozen, as_on_cuda, monkeypatch, tmp_path):
    from tests.helpers.models import save_tiny_llama
    from zllm import LLM

    monkeypatch.setenv("ZLLM_GC_FREEZE", "0")
    llm = LLM(str(save_tiny_llama(tmp_path / "tiny")), dtype="float32", max_model_len=64)
    assert gc.get_freeze_count() == 0
    llm.shutdown()


def test_an_offline_llm_dropped_without_shutdown_still_thaws_and_frees_its_model(unfrozen, as_on_cuda, tmp_path):
    from tests.helpers.models import save_tiny_llama
    from zllm import LLM

    llm = LLM(str(save_tiny_llama(tmp_path / "tiny")), dtype="float32", max_model_len=64)
    assert gc.get_freeze_count() > 0
    model = weakref.ref(llm.engine.core.executor.runner.model)
    del llm  # the last reference: its finalizer shuts the engine down and thaws the heap
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert model() is None


def test_generate_defers_the_oldest_generation_and_restores_the_thresholds(unfrozen, monkeypatch, tmp_path):
    from tests.helpers.models import save_tiny_llama
    from zllm import LLM, SamplingParams

    llm = LLM(str(save_tiny_llama(tmp_path / "tiny")), dtype="float32", max_model_len=64)
    before = gc.get_threshold()
    seen = []
    step = llm.engine.step

    def recorded_step():
        seen.append(gc.get_threshold())
        return step()

    monkeypatch.setattr(llm.engine, "step", recorded_step)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    # Young passes as before; the oldest generation's threshold out of reach while generating.
    assert seen and all(t[:2] == before[:2] and t[2] >= 1 << 30 for t in seen)
    assert gc.get_threshold() == before
    seen.clear()
    monkeypatch.setenv("ZLLM_GC_DEFER_OLD", "0")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert seen and all(t == before for t in seen)
    llm.shutdown()


def test_an_offline_llm_on_the_cpu_leaves_the_heap_alone(unfrozen, tmp_path):
    from tests.helpers.models import save_tiny_llama
    from zllm import LLM

    llm = LLM(str(save_tiny_llama(tmp_path / "tiny")), dtype="float32", max_model_len=64, device="cpu")
    assert gc.get_freeze_count() == 0
    llm.shutdown()
