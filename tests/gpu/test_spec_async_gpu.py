"""Speculative decoding with async scheduling on a GPU: a step with drafts is launched and
sampled without a host synchronisation (the rejection sampler's indices travel in one pinned
copy), and greedy requests get the same tokens from async and synchronous steps with drafts."""

from __future__ import annotations

import pytest

from tests.gpu.test_async_scheduling_gpu import PARAMS, _run
from tests.gpu.test_async_scheduling_gpu import model_dir as model_dir  # noqa: F401 (the fixture)

pytestmark = pytest.mark.gpu

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _greedy_only(results: dict[str, tuple]) -> dict[str, tuple]:
    """The requests whose tokens drafts cannot change: greedy, no logprobs (a seeded stream may
    draw differently when a step scores fewer drafts, which async does near max_tokens)."""
    return {
        rid: result
        for rid, result in results.items()
        if PARAMS[int(rid) % len(PARAMS)].temperature == 0.0 and PARAMS[int(rid) % len(PARAMS)].logprobs is None
    }


def test_greedy_tokens_with_async_drafts_equal_sync_drafts(model_dir):  # noqa: F811
    """Not against decoding without drafts: in bf16 a 1-row step (GEMV) and a verifying step
    (gemv_rows) may round a near-tie apart (architecture.md, "Which outputs are bit-stable");
    the CPU tests check that equality in fp32."""
    sync = _run(model_dir, async_scheduling=False, speculative_config=NGRAM)
    pipelined = _run(model_dir, async_scheduling=True, speculative_config=NGRAM)
    assert len(pipelined) == len(sync) == 2 * 8
    assert _greedy_only(pipelined) == _greedy_only(sync)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_launch_and_sample_of_draft_steps_never_wait_for_the_device(model_dir, enforce_eager):  # noqa: F811
    import torch

    drafted_steps = []

    def forbid_syncs(engine):
        runner = engine.core.executor.runner
        for name in ("launch_step", "sample_step"):
            original = getattr(runner, name)

            def strict(*args, _original=original, **kwargs):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return _original(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode(0)

            setattr(runner, name, strict)
        verify = runner._verify_drafts

        def counting(launched, grammar):
            drafted_steps.append(launched.step_id)
            return verify(launched, grammar)

        runner._verify_drafts = counting

    results = _run(
        model_dir, spy=forbid_syncs, async_scheduling=True, enforce_eager=enforce_eager, speculative_config=NGRAM
    )
    assert len(results) == 2 * 8
    assert drafted_steps  # steps with drafts were launched and sampled under the check
