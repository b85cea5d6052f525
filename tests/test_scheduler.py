"""The scheduler's rules, driven step by step with fabricated sampled tokens (no model)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from tests.helpers.scheduler import (
    EOS,
    TOKEN,
    add,
    assert_all_blocks_free,
    complete,
    decode,
    make_request,
    make_scheduler,
    num_used_blocks,
    prompt,
    run_step,
    run_to_completion,
    sampling_ids,
    scheduled,
)
from zllm.config import EngineConfig
from zllm.enginecore.request import Request, RequestStatus
from zllm.enginecore.scheduler import Scheduler
from zllm.ipc.messages import CachedRequestData, NewRequestData, StepInput, StepOutput, TokenDelta
from zllm.sampling_params import SamplingParams

STOP_TOKEN = 42


# ---- budget, max_num_seqs, order -------------------------------------------------------------


def test_token_budget_caps_scheduled_tokens_per_step():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, make_request("a", 5), make_request("b", 5), make_request("c", 5))

    first = run_step(scheduler)
    assert scheduled(first) == {"a": 5, "b": 3}
    assert first.total_num_scheduled_tokens == 8
    assert [r.request_id for r in scheduler.waiting] == ["c"]

    second = run_step(scheduler)
    assert scheduled(second) == {"a": 1, "b": 2, "c": 5}
    assert second.total_num_scheduled_tokens == 8


def test_max_num_seqs_caps_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    add(scheduler, *(make_request(r, 4, max_tokens=2) for r in "abc"))

    first = run_step(scheduler)
    assert first.scheduled_ids == ["a", "b"]
    assert len(scheduler.running) == 2
    assert scheduler.waiting.peek().request_id == "c"
    assert scheduler.requests["c"].status == RequestStatus.WAITING

    second = run_step(scheduler)
    assert second.scheduled_ids == ["a", "b"]
    assert scheduler.running == []

    third = run_step(scheduler)
    assert third.scheduled_ids == ["c"]
    assert len(scheduler.running) == 1


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=6)
    add(scheduler, make_request("a", 4))
    run_step(scheduler)
    add(scheduler, make_request("b", 4), make_request("c", 4))

    step = run_step(scheduler)
    assert step.scheduled_ids == ["a", "b", "c"]
    assert step.num_scheduled_tokens == [1, 4, 1]


def test_running_prefill_can_take_the_whole_budget_from_waiting_requests():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    add(scheduler, make_request("long", 12))
    run_step(scheduler)
    add(scheduler, make_request("short", 1))

    step = run_step(scheduler)
    assert scheduled(step) == {"long": 4}
    assert scheduler.requests["short"].status == RequestStatus.WAITING


def test_waiting_requests_are_admitted_in_arrival_order_without_overtaking():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    add(
        scheduler,
        make_request("a", 8, max_tokens=4),
        make_request("b", 8, max_tokens=4),
        make_request("c", 4, max_tokens=4),
    )

    step = run_step(scheduler)
    assert step.scheduled_ids == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.kv_cache.pool.num_free_blocks == 1


# ---- chunked prefill and the step diff ---------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_over_several_steps():
    scheduler = make_scheduler(max_num_batched_tokens=4, block_size=4)
    long = make_request("long", 10)
    add(scheduler, long, make_request("short", 2))

    first = scheduler.schedule()
    assert scheduled(first) == {"long": 4}
    assert first.new_requests[0].token_ids == prompt(10)
    assert first.new_requests[0].block_ids == [0]
    assert long.num_computed_tokens == 4
    assert sampling_ids(scheduler, first) == []
    assert complete(scheduler, first) == []

    second = scheduler.schedule()
    assert scheduled(second) == {"long": 4}
    assert second.cached_requests == [CachedRequestData("long", [1], 4)]
    assert long.num_computed_tokens == 8
    assert complete(scheduler, second) == []
    assert long.output_token_ids == []

    third = scheduler.schedule()
    assert scheduled(third) == {"long": 2, "short": 2}
    assert third.cached_requests == [CachedRequestData("long", [2], 8)]
    assert long.num_computed_tokens == 10
    deltas = complete(scheduler, third, {"long": 11, "short": 12})
    assert [(d.request_id, d.new_token_ids) for d in deltas] == [("long", [11]), ("short", [12])]


def test_step_input_sends_a_new_request_in_full_then_only_diffs():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", 6)
    add(scheduler, request)

    first = scheduler.schedule()
    assert first.new_requests == [
        NewRequestData(
            "a",
            prompt_len=6,
            token_ids=prompt(6),
            sampling=request.sampling,
            block_ids=[0, 1],
            num_computed_tokens=0,
            eos_token_ids=[EOS],
        )
    ]
    assert first.cached_requests == []
    complete(scheduler, first, {"a": 11})

    # The workers append the tokens they sampled themselves: a diff carries only new blocks.
    second = scheduler.schedule()
    assert second.new_requests == []
    assert second.cached_requests == [CachedRequestData("a", new_block_ids=[], num_computed_tokens=6)]
    complete(scheduler, second, {"a": 12})

    third = scheduler.schedule()
    assert third.cached_requests == [CachedRequestData("a", new_block_ids=[], num_computed_tokens=7)]
    complete(scheduler, third, {"a": 13})

    fourth = scheduler.schedule()
    assert fourth.cached_requests == [CachedRequestData("a", new_block_ids=[2], num_computed_tokens=8)]
    assert scheduler.kv_cache.block_ids("a") == [0, 1, 2]
    assert scheduler.requests["a"].output_token_ids == [11, 12, 13]


# ---- async scheduling: output placeholders -------------------------------------------------------


def answer(scheduler: Scheduler, step: StepInput, sampled: dict[str, int]) -> list[TokenDelta]:
    """Step `step`'s output, arriving after later steps were scheduled."""
    ids = list(sampled)
    return scheduler.update_from_output(StepOutput(step.step_id, ids, [sampled[i] for i in ids]))


def test_async_schedules_a_decode_before_its_previous_token_arrives():
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 6))
    first = scheduler.schedule()
    assert scheduled(first) == {"a": 6}
    second = scheduler.schedule()  # step 1's token is still in flight
    assert scheduled(second) == {"a": 1}
    assert second.cached_requests == [CachedRequestData("a", new_block_ids=[], num_computed_tokens=6)]
    request = scheduler.requests["a"]
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 7
    answer(scheduler, first, {"a": 11})
    third = scheduler.schedule()
    assert scheduled(third) == {"a": 1} and request.num_computed_tokens == 8
    answer(scheduler, second, {"a": 12})
    answer(scheduler, third, {"a": 13})
    assert request.output_token_ids == [11, 12, 13] and request.num_output_placeholders == 0


def test_sync_never_schedules_a_token_it_does_not_have():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 6))
    scheduler.schedule()
    assert scheduler.schedule().is_empty


def test_async_does_not_compute_past_max_tokens_in_flight():
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 4, max_tokens=2))
    first, second = scheduler.schedule(), scheduler.schedule()
    assert scheduled(second) == {"a": 1}
    assert scheduler.schedule().is_empty  # two tokens in flight: the second is the last
    answer(scheduler, first, {"a": 11})
    deltas = answer(scheduler, second, {"a": 12})
    assert deltas[-1].finish_reason == "length" and "a" not in scheduler.requests


def test_async_drops_a_finished_requests_extra_token():
    scheduler = make_scheduler(async_scheduling=True)
    add(scheduler, make_request("a", 4))
    first, second = scheduler.schedule(), scheduler.schedule()
    deltas = answer(scheduler, first, {"a": EOS})
    assert deltas[0].finish_reason == "stop"
    third = scheduler.schedule()
    assert third.finished_ids == ["a"] and third.is_empty
    assert answer(scheduler, second, {"a": 11}) == []  # sampled after its end: discarded
    assert scheduler.kv_cache.pool.num_free_blocks == 64


def test_async_drops_tokens_in_flight_when_a_request_is_preempted():
    # 3 blocks of 4 tokens: a (4 prompt) and b (4 prompt) fill two; growing both needs a fourth.
    scheduler = make_scheduler(async_scheduling=True, num_blocks=3)
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    add(scheduler, a, b)
    first = scheduler.schedule()
    assert scheduled(first) == {"a": 4, "b": 4}
    second = scheduler.schedule()  # both decode into a new block each: b is preempted
    assert second.preempted_ids == ["b"] and scheduled(second) == {"a": 1}
    assert b.num_stale_outputs == 1 and b.num_output_placeholders == 0
    answer(scheduler, first, {"a": 11, "b": 21})  # b's token was sampled before it was preempted
    assert b.output_token_ids == [] and b.num_stale_outputs == 0
    answer(scheduler, second, {"a": 12})
    assert a.output_token_ids == [11, 12]


def test_step_ids_increase_by_one():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4))
    assert [run_step(scheduler).step_id for _ in range(3)] == [1, 2, 3]


# ---- preemption ----------------------------------------------------------------------------


def test_pool_shortage_preempts_the_latest_running_request_for_recompute():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    a, b, c = (
        make_request("a", 3, max_tokens=4),
        make_request("b", 12, max_tokens=3),
        make_request("c", 1, max_tokens=3),
    )
    add(scheduler, a, b, c)

    assert scheduled(run_step(scheduler)) == {"a": 3, "b": 5}
    assert scheduled(run_step(scheduler, {"b": 21})) == {"a": 1, "b": 7}
    assert scheduler.kv_cache.pool.num_free_blocks == 0
    assert b.output_token_ids == [21]

    step = scheduler.schedule()
    assert scheduled(step) == {"a": 1}
    assert step.preempted_ids == ["b"]
    assert step.new_requests == []
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert scheduler.kv_cache.block_ids("b") == []
    assert scheduler.kv_cache.pool.num_free_blocks == 2
    assert scheduler.running == [a]
    assert list(scheduler.waiting) == [b, c]
    assert b.num_preemptions == 1
    assert scheduler.stats().num_preemptions == 1
    complete(scheduler, step)

    resumed = scheduler.schedule()
    assert scheduled(resumed) == {"a": 1, "b": 7}
    assert resumed.preempted_ids == []
    (new,) = resumed.new_requests
    assert new.request_id == "b"
    assert new.prompt_len == 12
    assert new.token_ids == prompt(12) + [21]
    assert new.num_computed_tokens == 0
    assert new.block_ids == scheduler.kv_cache.block_ids("b")
    assert len(new.block_ids) == 2
    assert b.status == RequestStatus.RUNNING
    complete(scheduler, resumed)

    run_to_completion(scheduler)
    assert b.output_token_ids[0] == 21
    assert b.num_output_tokens == 3
    assert a.num_output_tokens == 4
    assert_all_blocks_free(scheduler)


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)
    add(
        scheduler,
        make_request("a", 3, max_tokens=4),
        make_request("b", 12, max_tokens=4),
        make_request("c", 1, max_tokens=4),
    )
    run_step(scheduler)
    run_step(scheduler)

    step = scheduler.schedule()
    assert step.preempted_ids == ["b"]
    assert step.new_requests == []
    assert len(scheduler.running) < scheduler.max_num_seqs
    assert scheduler.kv_cache.pool.num_free_blocks == 2
    assert step.total_num_scheduled_tokens < scheduler.max_num_batched_tokens


def test_latest_request_that_cannot_grow_preempts_itself_and_resumes_later():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    a, b = make_request("a", 4, max_tokens=3), make_request("b", 4, max_tokens=3)
    add(scheduler, a, b)
    run_step(scheduler, {"b": 31})

    step = scheduler.schedule()
    assert scheduled(step) == {"a": 1}
    assert step.preempted_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED
    assert list(scheduler.waiting) == [b]
    assert scheduler.kv_cache.block_ids("b") == []
    complete(scheduler, step)

    waiting_step = run_step(scheduler)
    assert scheduled(waiting_step) == {"a": 1}
    assert waiting_step.preempted_ids == []
    assert a.status == RequestStatus.FINISHED_LENGTH

    resumed = scheduler.schedule()
    assert resumed.finished_ids == ["a"]
    assert [n.request_id for n in resumed.new_requests] == ["b"]
    assert resumed.new_requests[0].token_ids == prompt(4) + [31]
    complete(scheduler, resumed)

    run_to_completion(scheduler)
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids[0] == 31
    assert b.num_output_tokens == 3
    assert b.num_preemptions == 1
    assert_all_blocks_free(scheduler)


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "field"),
    [(8, 1, "prompt"), (12, 4, "prompt"), (4, 5, "max_tokens"), (4, None, "max_tokens")],
)
def test_request_that_could_outgrow_the_whole_pool_is_refused_naming_the_field(prompt_len, max_tokens, field):
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=rf"^{field}: .* need \d+ KV blocks of 4 tokens, but the whole KV cache has 2"):
        scheduler.add_request(make_request("a", prompt_len, max_tokens=max_tokens))
    assert not scheduler.has_unfinished_requests()
    assert not scheduler.waiting

    fits = make_request("b", 4, max_tokens=4)  # 8 tokens: exactly the pool
    scheduler.add_request(fits)
    run_to_completion(scheduler)
    assert fits.num_output_tokens == 4
    assert_all_blocks_free(scheduler)


# ---- scheduling policies --------------------------------------------------------------------------


def prioritized(
    request_id: str, priority: int, arrival_time: float, prompt_len: int = 4, max_tokens: int = 2
) -> Request:
    request = make_request(request_id, prompt_len, max_tokens=max_tokens)
    request.priority, request.arrival_time = priority, arrival_time
    return request


def test_priority_policy_serves_the_lowest_value_first_then_the_earliest_arrival():
    scheduler = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    add(
        scheduler,
        prioritized("late-low", 5, 1.0),
        prioritized("urgent", -1, 3.0),
        prioritized("early-mid", 2, 0.5),
        prioritized("late-mid", 2, 2.0),
    )
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "early-mid", "late-mid", "late-low"]
    admitted = []
    while scheduler.has_unfinished_requests():
        step = run_step(scheduler)
        admitted += [n.request_id for n in step.new_requests]
    assert admitted == ["urgent", "early-mid", "late-mid", "late-low"]


def test_fcfs_policy_ignores_priority():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, prioritized("first", 9, 0.0), prioritized("second", 0, 1.0))
    assert run_step(scheduler).scheduled_ids == ["first"]


def test_priority_policy_preempts_the_least_important_running_request_even_one_scheduled_this_step():
    scheduler = make_scheduler(num_blocks=3, block_size=4, scheduling_policy="priority")
    low, high = prioritized("low", 5, 0.0, max_tokens=4), prioritized("high", 0, 1.0, max_tokens=4)
    add(scheduler, low, high)
    first = run_step(scheduler)
    assert first.scheduled_ids == ["high", "low"]  # admitted by priority
    scheduler.running = [low, high]  # the order they run in does not decide the victim

    step = scheduler.schedule()  # both need a 2nd block; one is free
    assert scheduled(step) == {"high": 1}
    assert step.preempted_ids == ["low"]  # scheduled first in this step, then preempted for "high"
    assert step.total_num_scheduled_tokens == 1
    assert low.status == RequestStatus.PREEMPTED and scheduler.kv_cache.block_ids("low") == []
    complete(scheduler, step)
    run_to_completion(scheduler)
    assert high.num_output_tokens == 4 and low.num_output_tokens == 4
    assert_all_blocks_free(scheduler)


def test_priority_preemption_puts_the_victim_back_in_priority_order():
    scheduler = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, scheduling_policy="priority")
    low, high = prioritized("low", 5, 0.0, max_tokens=4), prioritized("high", 0, 1.0, max_tokens=4)
    add(scheduler, low, high)
    run_step(scheduler)
    add(scheduler, prioritized("later-low", 5, 2.0), prioritized("mid", 3, 3.0))
    step = run_step(scheduler)
    assert step.preempted_ids == ["low"]
    assert [r.request_id for r in scheduler.waiting] == ["mid", "low", "later-low"]


# ---- stop rules ----------------------------------------------------------------------------


def test_eos_finishes_with_stop_and_frees_blocks():
    scheduler = make_scheduler()
    request = make_request("a", 4)
    add(scheduler, request)
    run_step(scheduler)

    (delta,) = decode(scheduler, "a", [EOS])
    assert delta == TokenDelta("a", [EOS], finish_reason="stop", stop_reason=None)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [TOKEN, EOS]
    assert scheduler.running == []
    assert "a" not in scheduler.requests
    assert_all_blocks_free(scheduler)


def test_finished_ids_are_reported_in_the_next_step_exactly_once():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4), make_request("b", 4), make_request("c", 4))
    first = scheduler.schedule()
    assert first.finished_ids == []
    complete(scheduler, first, {"a": EOS, "c": EOS})

    second = run_step(scheduler)
    assert second.finished_ids == ["a", "c"]
    assert second.scheduled_ids == ["b"]
    assert run_step(scheduler).finished_ids == []


def test_ignore_eos_keeps_generating_until_max_tokens():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4, max_tokens=3, ignore_eos=True))
    deltas = decode(scheduler, "a", [EOS, EOS, EOS])
    assert [d.finish_reason for d in deltas] == [None, None, "length"]


def test_stop_token_id_finishes_with_the_token_as_stop_reason():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4, stop_token_ids=[STOP_TOKEN]))
    deltas = decode(scheduler, "a", [TOKEN, STOP_TOKEN])
    assert [(d.finish_reason, d.stop_reason) for d in deltas] == [(None, None), ("stop", STOP_TOKEN)]


def test_stop_token_ids_still_apply_with_ignore_eos():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4, ignore_eos=True, stop_token_ids=[STOP_TOKEN]))
    deltas = decode(scheduler, "a", [EOS, STOP_TOKEN])
    assert [(d.finish_reason, d.stop_reason) for d in deltas] == [(None, None), ("stop", STOP_TOKEN)]


def test_max_tokens_finishes_with_length():
    scheduler = make_scheduler()
    request = make_request("a", 4, max_tokens=3)
    add(scheduler, request)
    deltas = decode(scheduler, "a", [11, 12, 13])
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [11, 12, 13]
    assert_all_blocks_free(scheduler)


def test_eos_on_the_last_allowed_token_reports_stop():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4, max_tokens=2))
    deltas = decode(scheduler, "a", [TOKEN, EOS])
    assert [d.finish_reason for d in deltas] == [None, "stop"]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4, min_tokens=3, stop_token_ids=[STOP_TOKEN]))
    deltas = decode(scheduler, "a", [EOS, STOP_TOKEN, EOS])
    assert [d.finish_reason for d in deltas] == [None, None, "stop"]


def test_stop_token_counts_once_min_tokens_is_reached():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4, min_tokens=2, stop_token_ids=[STOP_TOKEN]))
    deltas = decode(scheduler, "a", [STOP_TOKEN, STOP_TOKEN])
    assert [(d.finish_reason, d.stop_reason) for d in deltas] == [(None, None), ("stop", STOP_TOKEN)]


def test_reaching_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("a", 5, max_tokens=None)
    add(scheduler, request)
    deltas = decode(scheduler, "a", [11, 12, 13])
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert request.num_tokens == 8
    assert request.num_computed_tokens < 8
    assert_all_blocks_free(scheduler)


def test_max_model_len_wins_over_min_tokens():
    scheduler = make_scheduler(max_model_len=8)
    add(scheduler, make_request("a", 5, max_tokens=10, min_tokens=10))
    deltas = decode(scheduler, "a", [11, 12, 13])
    assert [d.finish_reason for d in deltas] == [None, None, "length"]


# ---- abort and bookkeeping --------------------------------------------------------------------


def test_abort_waiting_request_is_never_reported_to_workers():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, make_request("a", 4), make_request("b", 4))
    run_step(scheduler)

    assert scheduler.abort_requests(["b"]) == ["b"]
    assert list(scheduler.waiting) == []
    assert "b" not in scheduler.requests
    assert scheduler.schedule().finished_ids == []


def test_abort_running_request_frees_blocks_and_is_reported_next_step():
    scheduler = make_scheduler()
    a, b = make_request("a", 4), make_request("b", 8)
    add(scheduler, a, b)
    run_step(scheduler)
    assert num_used_blocks(scheduler) == 3

    assert scheduler.abort_requests(["b"]) == ["b"]
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert b.status.finish_reason == "abort"
    assert scheduler.running == [a]
    assert scheduler.kv_cache.block_ids("b") == []
    assert num_used_blocks(scheduler) == 1

    step = run_step(scheduler)
    assert step.finished_ids == ["b"]
    assert step.scheduled_ids == ["a"]
    assert run_step(scheduler).finished_ids == []


def test_abort_returns_only_known_unfinished_ids():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4), make_request("done", 4, max_tokens=1))
    run_step(scheduler)
    assert "done" not in scheduler.requests

    assert scheduler.abort_requests(["nope", "a", "done", "a"]) == ["a"]
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_abort_preempted_request_is_not_reported_again():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    add(scheduler, make_request("a", 4, max_tokens=4), make_request("b", 4, max_tokens=4))
    run_step(scheduler)
    preempting = run_step(scheduler)
    assert preempting.preempted_ids == ["b"]

    assert scheduler.abort_requests(["b"]) == ["b"]
    assert scheduler.schedule().finished_ids == []


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", 2))
    assert len(scheduler.waiting) == 1


def test_tokens_sampled_for_a_request_aborted_during_the_step_are_ignored():
    scheduler = make_scheduler()
    a, b = make_request("a", 4), make_request("b", 4)
    add(scheduler, a, b)
    step = scheduler.schedule()

    scheduler.abort_requests(["a"])
    deltas = scheduler.update_from_output(StepOutput(step.step_id, ["a", "b"], [11, 12]))
    assert [(d.request_id, d.new_token_ids) for d in deltas] == [("b", [12])]
    assert a.output_token_ids == []
    assert scheduler.schedule().finished_ids == ["a"]


def test_tokens_of_an_aborted_request_do_not_reach_a_new_request_reusing_its_id():
    scheduler = make_scheduler()
    add(scheduler, make_request("a", 4))
    step = scheduler.schedule()

    scheduler.abort_requests(["a"])
    successor = make_request("a", 3)
    add(scheduler, successor)
    assert scheduler.update_from_output(StepOutput(step.step_id, ["a"], [11])) == []
    assert successor.output_token_ids == []
    assert successor.status == RequestStatus.WAITING


def test_stats_reflect_queues_and_cache_usage():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    add(scheduler, make_request("a", 8), make_request("b", 4))
    run_step(scheduler)
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (1, 1, 0)
    assert stats.kv_cache_usage == pytest.approx(2 / 8)


# ---- randomized workload ------------------------------------------------------------------------


@dataclass
class WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeWorkers:
    """Rebuilds the workers' persistent batch from the StepInput diffs alone, checking each one.
    Like the real workers, it appends the tokens it sampled itself (`finish`), which under async
    scheduling happens after the next step was launched: until then a request may compute one
    token past the ones it holds (the one in flight)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.batch: dict[str, WorkerRequest] = {}
        self.in_flight: dict[str, tuple[WorkerRequest, int]] = {}  # samples not yet appended

    def _num_in_flight(self, request_id: str, held: WorkerRequest) -> int:
        entry = self.in_flight.get(request_id)
        return entry[1] if entry is not None and entry[0] is held else 0

    def finish(self, sampling: list[str], tokens: list[int]) -> None:
        for request_id, token in zip(sampling, tokens):
            held = self.batch.get(request_id)
            count = self._num_in_flight(request_id, held)
            if count:
                held.token_ids.append(token)
                self.in_flight[request_id] = (held, count - 1)

    def execute(self, step: StepInput) -> list[str]:
        for request_id in (*step.finished_ids, *step.preempted_ids):
            assert request_id in self.batch, f"{request_id} dropped but never sent"
            del self.batch[request_id]
            self.in_flight.pop(request_id, None)
        for new in step.new_requests:
            assert new.request_id not in self.batch, f"{new.request_id} sent in full twice"
            copy = WorkerRequest(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            self.batch[new.request_id] = copy
        for cached in step.cached_requests:
            held = self.batch[cached.request_id]
            assert held.num_computed_tokens == cached.num_computed_tokens
            held.block_ids += cached.new_block_ids
        sampling = []
        for request_id, num_tokens in zip(step.scheduled_ids, step.num_scheduled_tokens):
            held = self.batch[request_id]
            assert num_tokens > 0
            held.num_computed_tokens += num_tokens
            known = len(held.token_ids) + self._num_in_flight(request_id, held)
            assert held.num_computed_tokens <= known
            assert len(held.block_ids) * self.block_size >= held.num_computed_tokens
            if held.num_computed_tokens == known:
                sampling.append(request_id)
        for request_id in sampling:
            held = self.batch[request_id]
            self.in_flight[request_id] = (held, self._num_in_flight(request_id, held) + 1)
        return sampling


def random_request(rng: random.Random, index: int, max_prompt_len: int) -> Request:
    max_tokens = rng.choice([None, rng.randint(1, 30)])
    return Request(
        request_id=f"r{index}",
        prompt_token_ids=[rng.randint(10, 99) for _ in range(rng.randint(1, max_prompt_len))],
        sampling=SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, min(3, max_tokens or 3)),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=[STOP_TOKEN] if rng.random() < 0.5 else None,
        ),
        eos_token_ids=frozenset({EOS}),
    )


def random_token(rng: random.Random) -> int:
    roll = rng.random()
    if roll < 0.04:
        return EOS
    if roll < 0.06:
        return STOP_TOKEN
    return rng.randint(10, 99)


def assert_step_invariants(scheduler: Scheduler, step: StepInput, workers: FakeWorkers) -> None:
    kv_cache = scheduler.kv_cache
    assert step.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(set(step.scheduled_ids)) == len(step.scheduled_ids)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    assert set(step.scheduled_ids) <= {r.request_id for r in scheduler.running}
    held = 0
    for request in scheduler.running:
        blocks = kv_cache.block_ids(request.request_id)
        assert len(blocks) * kv_cache.block_size >= request.num_computed_tokens
        assert request.num_computed_tokens <= min(request.num_tokens, scheduler.max_model_len)
        held += len(blocks)
    for request in scheduler.waiting:
        assert kv_cache.block_ids(request.request_id) == []
        assert request.num_computed_tokens == 0
    assert held + kv_cache.pool.num_free_blocks == kv_cache.pool.num_blocks
    for request_id in step.scheduled_ids:
        request, copy = scheduler.requests[request_id], workers.batch[request_id]
        assert copy.token_ids == request.all_token_ids
        assert copy.block_ids == kv_cache.block_ids(request_id)
        assert copy.num_computed_tokens == request.num_computed_tokens


def test_random_workload_with_preemptions_and_aborts_finishes_without_leaks():
    rng = random.Random(1234)
    block_size, max_model_len = 4, 48
    scheduler = make_scheduler(
        num_blocks=20, block_size=block_size, max_model_len=max_model_len, max_num_seqs=6, max_num_batched_tokens=16
    )
    workers = FakeWorkers(block_size)
    pending = [random_request(rng, i, max_model_len - 1) for i in range(80)]
    submitted: dict[str, Request] = {}
    streamed: dict[str, list[int]] = {}
    aborted: set[str] = set()

    for _ in range(5000):
        while pending and rng.random() < 0.3:
            request = pending.pop(0)
            scheduler.add_request(request)
            submitted[request.request_id] = request
            streamed[request.request_id] = []
        if not pending and not scheduler.has_unfinished_requests():
            break
        had_work = scheduler.has_unfinished_requests()
        step = scheduler.schedule()
        sampling = workers.execute(step)
        assert_step_invariants(scheduler, step, workers)
        assert sampling == sampling_ids(scheduler, step)
        assert step.is_empty != had_work

        if scheduler.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(scheduler.requests))
            assert scheduler.abort_requests([victim]) == [victim]
            aborted.add(victim)

        tokens = [random_token(rng) for _ in sampling]
        workers.finish(sampling, tokens)
        deltas = scheduler.update_from_output(StepOutput(step.step_id, sampling, tokens))
        for delta in deltas:
            assert delta.request_id not in aborted
            streamed[delta.request_id] += delta.new_token_ids
    else:
        pytest.fail("the workload did not finish")

    workers.execute(scheduler.schedule())
    assert workers.batch == {}
    assert_all_blocks_free(scheduler)
    assert all(b.ref_cnt == 0 for b in scheduler.kv_cache.pool.blocks)
    assert scheduler.running == [] and not scheduler.waiting
    assert scheduler.num_preemptions > 0
    assert aborted

    assert_finished_correctly(submitted, streamed, max_model_len)


def assert_finished_correctly(
    submitted: dict[str, Request], streamed: dict[str, list[int]], max_model_len: int
) -> None:
    for request_id, request in submitted.items():
        assert request.status.is_finished
        assert streamed[request_id] == request.output_token_ids
        assert request.num_tokens <= max_model_len
        if request.sampling.max_tokens is not None:
            assert request.num_output_tokens <= request.sampling.max_tokens
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_tokens == max_model_len or request.num_output_tokens == request.sampling.max_tokens
        if request.status == RequestStatus.FINISHED_STOPPED:
            assert request.num_output_tokens >= request.sampling.min_tokens


def test_engine_core_delivers_finished_ids_even_when_nothing_else_is_scheduled(tmp_path):
    from transformers import LlamaConfig

    from zllm.enginecore.core import EngineCore
    from zllm.ipc.messages import AddRequest, StepOutput

    class RecordingExecutor:
        def __init__(self):
            self.steps = []

        def determine_num_kv_blocks(self):
            return 8

        def initialize_kv_cache(self, num_blocks):
            pass

        def submit_step(self, step):
            self.steps.append(step)

        def collect_step(self, flush):
            step = self.steps[-1]
            sampled = [rid for rid, n in zip(step.scheduled_ids, step.num_scheduled_tokens)]
            return StepOutput(step_id=step.step_id, request_ids=sampled, sampled_token_ids=[2] * len(sampled))

        def shutdown(self):
            pass

    executor = RecordingExecutor()
    # The core reads the model's layers (their windows) from its config.json.
    LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path
    )
    core = EngineCore(EngineConfig(model=str(tmp_path), max_model_len=32, block_size=4), executor)
    core.add_request(AddRequest("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4), 0.0, eos_token_ids=[2]))
    core.step()  # prefill; samples EOS and finishes
    assert not core.has_unfinished_requests()
    core.step()  # nothing to run, but the workers must hear that "a" is gone
    assert executor.steps[-1].finished_ids == ["a"] and executor.steps[-1].is_empty
    assert core.step() == [] and len(executor.steps) == 2


def test_random_async_workload_with_two_steps_in_flight_finishes_without_leaks():
    """As the engine core runs async scheduling: step N+1 is scheduled and launched before step
    N's tokens are appended (by the workers) and applied (by the scheduler)."""
    rng = random.Random(99)
    block_size, max_model_len = 4, 48
    scheduler = make_scheduler(
        num_blocks=20,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        async_scheduling=True,
    )
    workers = FakeWorkers(block_size)
    pending = [random_request(rng, i, max_model_len - 1) for i in range(80)]
    submitted: dict[str, Request] = {}
    streamed: dict[str, list[int]] = {}
    in_flight: list[tuple[StepInput, list[str], list[int]]] = []
    for _ in range(10000):
        while pending and rng.random() < 0.3:
            request = pending.pop(0)
            scheduler.add_request(request)
            submitted[request.request_id] = request
            streamed[request.request_id] = []
        if not pending and not scheduler.has_unfinished_requests() and not in_flight:
            break
        if len(in_flight) < 2:
            step = scheduler.schedule()
            if not step.is_empty or step.finished_ids or step.preempted_ids:
                sampling = workers.execute(step)
                in_flight.append((step, sampling, [random_token(rng) for _ in sampling]))
                if len(in_flight) < 2:
                    continue
        if not in_flight:
            continue
        step, sampling, tokens = in_flight.pop(0)
        workers.finish(sampling, tokens)
        if scheduler.requests and rng.random() < 0.03:
            scheduler.abort_requests([rng.choice(sorted(scheduler.requests))])
        for delta in scheduler.update_from_output(StepOutput(step.step_id, sampling, tokens)):
            streamed[delta.request_id] += delta.new_token_ids
    else:
        pytest.fail("the workload did not finish")

    workers.execute(scheduler.schedule())
    assert workers.batch == {}
    assert_all_blocks_free(scheduler)
    assert scheduler.num_preemptions > 0
    assert scheduler.requests == {} and scheduler.running == []
    aborted = {rid for rid, r in submitted.items() if r.status == RequestStatus.FINISHED_ABORTED}
    assert aborted
    finished = {rid: r for rid, r in submitted.items() if rid not in aborted}
    assert_finished_correctly(finished, streamed, max_model_len)


# ---- a request that fails on the workers ---------------------------------------------------------


def test_request_failed_on_the_workers_ends_alone_and_readers_of_its_blocks_recompute():
    """A fails on the workers in the step that admits it. B, admitted next in the same step, took
    A's (never computed) prefix blocks from the cache: B is recomputed from scratch, and those
    blocks leave the cache. C shares nothing and goes on untouched."""
    scheduler = make_scheduler(enable_prefix_caching=True)
    a = make_request("a", 10)
    b = Request("b", prompt(8) + [500, 501], SamplingParams(temperature=0, max_tokens=16))
    c = Request("c", [300 + i for i in range(6)], SamplingParams(temperature=0, max_tokens=16))
    add(scheduler, a, b, c)
    step = scheduler.schedule()
    assert scheduled(step) == {"a": 10, "b": 2, "c": 6}  # b starts after a's two full blocks

    output = StepOutput(step.step_id, ["b", "c"], [TOKEN, TOKEN], failed_requests={"a": "RuntimeError: boom"})
    deltas = scheduler.update_from_output(output)

    assert deltas == [TokenDelta("a", [], finish_reason="error", error="RuntimeError: boom"), TokenDelta("c", [TOKEN])]
    assert "a" not in scheduler.requests
    assert b.status == RequestStatus.PREEMPTED and b.output_token_ids == []  # its token was read off bad blocks
    assert scheduler.running == [c] and c.output_token_ids == [TOKEN]
    assert scheduler.kv_cache.find_cached_prefix(make_request("again", 10)).blocks == []  # a's blocks left the cache

    step = scheduler.schedule()
    assert step.finished_ids == ["a"] and step.preempted_ids == ["b"]  # the workers drop both
    resent = {r.request_id: r for r in step.new_requests}
    assert resent["b"].num_computed_tokens == 0 and scheduled(step) == {"c": 1, "b": 10}


# ---- default limits by use and device ---------------------------------------------------------------


def test_offline_use_on_a_gpu_raises_only_the_limits_left_unset(tmp_path):
    """LLM (usage "offline") on a GPU takes 512 sequences and 8192 tokens per step unless given
    others; a server, and anything on CPU, keeps 256 and 2048. No GPU is needed: device="cuda"
    decides it, and creating the config starts nothing."""
    from tests.helpers.models import save_tiny_llama

    model = str(save_tiny_llama(tmp_path / "m"))

    def limits(**kwargs) -> tuple[int, int]:
        config = EngineConfig.create(model, **kwargs)
        return config.max_num_seqs, config.max_num_batched_tokens

    assert limits(usage="offline", device="cuda") == (512, 8192)
    assert limits(usage="offline", device="cuda", max_num_seqs=64) == (64, 8192)
    assert limits(usage="offline", device="cuda", max_num_batched_tokens=None, max_num_seqs=None) == (512, 8192)
    assert limits(usage="offline", device="cuda", max_num_batched_tokens=1024) == (512, 1024)
    assert limits(usage="serving", device="cuda") == (256, 2048)
    assert limits(usage="offline", device="cpu") == (256, 2048)
    assert limits(device="cpu") == (256, 2048)
    with pytest.raises(ValueError, match="usage: must be one of"):
        EngineConfig.create(model, usage="batch", device="cpu")


def test_piecewise_sizes_pad_a_step_by_32_tokens_or_a_quarter_at_most_and_end_at_the_budget():
    from zllm.workers.piecewise_graphs import piecewise_sizes

    sizes = piecewise_sizes(2048)
    assert sizes[0] == 16 and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    for tokens in range(17, 2049):
        padded = next(s for s in sizes if s >= tokens)
        assert padded - tokens <= max(31, tokens // 4), (tokens, padded)
    assert piecewise_sizes(64)[-1] == 64 and piecewise_sizes(100)[-1] == 100
    assert piecewise_sizes(8192)[-1] == 2048  # larger steps run eagerly


# ---- images: the encoder cache's account ------------------------------------------------------


def _image_request(request_id: str, spans: list[tuple[int, int, str]], prompt_len: int = 40):
    from zllm.ipc.messages import ArrayData, ImageInput

    request = make_request(request_id, prompt_len)
    request.mm_inputs = [ImageInput(h, o, n, ArrayData("float32", [0], b""), [1, 2, 2]) for o, n, h in spans]
    request.image_spans = list(spans)
    return request


def test_a_chunk_stops_before_an_image_the_encoder_cannot_take():
    """The step's encoder budget (the cache's capacity) holds one 10-token image: the second
    request's chunk stops before its own image; the next step encodes it, then the first one's
    entry, no longer needed, is evicted (the workers are told)."""
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.encoder_cache.capacity = 10
    first, second = _image_request("a", [(2, 10, "h1")]), _image_request("b", [(5, 10, "h2")])
    add(scheduler, first, second)
    step = scheduler.schedule()
    assert scheduled(step) == {"a": 40, "b": 5}
    assert step.encode == {"a": [0]} and step.freed_mm_hashes == []
    step = scheduler.schedule()  # a decodes; b goes on from its image
    assert scheduled(step)["b"] == 35
    assert step.encode == {"b": [0]} and step.freed_mm_hashes == ["h1"]
    stats = scheduler.stats()
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (2, 0)


def test_a_repeated_image_is_a_hit_and_chunks_cut_through_it():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(
        scheduler,
        _image_request("a", [(3, 12, "h")], prompt_len=20),
        _image_request("b", [(1, 12, "h")], prompt_len=20),
    )
    steps = [scheduler.schedule() for _ in range(6)]
    encodes = [step.encode for step in steps if step.encode]
    assert encodes == [{"a": [0]}]  # once, in the first step that reached it
    assert scheduler.stats().encoder_cache_hits == 1  # b read a's entry


_MLA = dict(moe_intermediate_size=32, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16)
_MLA.update(v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1)


@pytest.mark.parametrize(
    "architecture, overrides",
    [
        ("llama", {}),
        ("qwen2_moe", {}),
        ("deepseek_v2", dict(_MLA, q_lora_rank=None, topk_method="greedy")),  # V2-Lite: q_proj
        ("deepseek_v3", dict(_MLA, q_lora_rank=24, n_group=4, topk_group=2)),  # q_a_proj, q_b_proj
        ("gpt_oss", {}),
    ],
    ids=["llama", "qwen2_moe", "v2-lite", "v3", "gpt_oss"],
)
def test_linear_weights_per_token_count_what_transformers_builds(tmp_path, architecture, overrides):
    """A prefill token's linear weights (the server's token budget scales by them) against the
    tensors of the model transformers builds: every matrix of the decoder layers, the routed
    experts' at top_k of num_experts, no router, bias, norm, embedding or LM head."""
    import transformers

    from tests.helpers.models import save_tiny_model
    from zllm.model_spec import ModelSpec

    model_dir = save_tiny_model(tmp_path / architecture, architecture, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    spec = ModelSpec.from_pretrained(str(model_dir))
    routed = spec.moe.top_k / spec.moe.num_experts if spec.moe is not None else 0.0
    expected = 0
    for name, tensor in model.model.layers.named_parameters():
        if (
            tensor.dim() < 2
            or "bias" in name
            or name.endswith(("mlp.gate.weight", "router.weight", "expert_gate.weight"))
        ):
            continue
        routed_expert = ".experts." in name and "shared" not in name
        expected += round(tensor.numel() * routed) if routed_expert else tensor.numel()
    assert spec.linear_weights_per_token() == expected


def test_a_server_on_a_gpu_sizes_its_token_budget_by_the_weights_per_gpu(tmp_path):
    """vllm-launch on a GPU: 2048 tokens a step for Llama-3-8B's weights per GPU and fewer, down
    to 512 by powers of two as a GPU holds more (70B: 512 at tp 4, 1024 at tp 8); a budget given
    is kept, and offline use and CPUs keep their own defaults."""
    from transformers import LlamaConfig

    from zllm.config import serving_token_budget
    from zllm.model_spec import ModelSpec

    def llama(directory, **shape) -> str:
        LlamaConfig(vocab_size=128256, max_position_embeddings=8192, **shape).save_pretrained(directory)
        return str(directory)

    shape_8b = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
    shape_70b = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
    llama_8b = llama(tmp_path / "8b", num_key_value_heads=8, **shape_8b)
    llama_70b = llama(tmp_path / "70b", num_key_value_heads=8, **shape_70b)
    spec_70b = ModelSpec.from_pretrained(llama_70b)
    assert [serving_token_budget(spec_70b, tp) for tp in (1, 2, 4, 8, 16)] == [512, 512, 512, 1024, 2048]
    assert serving_token_budget(ModelSpec.from_pretrained(llama_8b), 1) == 2048

    def budget(model: str, **kwargs) -> int:
        return EngineConfig.create(model, load_format="dummy", **kwargs).max_num_batched_tokens

    assert budget(llama_8b, device="cuda") == 2048
    assert budget(llama_70b, device="cuda") == 512
    assert budget(llama_70b, device="cuda", max_num_batched_tokens=2048) == 2048
    assert budget(llama_70b, device="cuda", usage="offline") == 8192
    assert budget(llama_70b, device="cpu") == 2048
