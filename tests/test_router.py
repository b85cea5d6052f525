"""The data-parallel frontend's choice of engine (zllm/frontend/router.py): least load as the
engines report it plus what was sent since, ties broken by the prompt's first KV block."""

from __future__ import annotations

import pytest

from zllm.frontend.router import LoadBalancer

BLOCK = 4
PREFIX_A = [1, 2, 3, 4, 9]
PREFIX_B = [5, 6, 7, 8, 9]


def test_the_least_loaded_engine_takes_the_request():
    balancer = LoadBalancer(3, BLOCK)
    balancer.report(0, num_waiting=2, num_running=5)
    balancer.report(1, num_waiting=0, num_running=3)
    balancer.report(2, num_waiting=1, num_running=4)
    assert balancer.choose([1, 2]) == 1


def test_a_burst_between_reports_spreads_over_the_engines():
    balancer = LoadBalancer(2, BLOCK)
    chosen = [balancer.choose([7]) for _ in range(6)]
    assert chosen == [0, 1, 0, 1, 0, 1]
    assert balancer.load(0) == balancer.load(1) == 3


def test_a_report_replaces_what_was_counted_since_the_last_one():
    balancer = LoadBalancer(2, BLOCK)
    for _ in range(4):
        balancer.choose([7])
    balancer.report(0, num_waiting=0, num_running=0)  # engine 0 finished its two
    assert balancer.load(0) == 0 and balancer.load(1) == 2
    assert balancer.choose([7]) == 0


def test_ties_go_to_the_engine_that_holds_the_same_first_block():
    balancer = LoadBalancer(2, BLOCK)
    assert balancer.choose(PREFIX_A) == 0
    assert balancer.choose(PREFIX_B) == 1
    balancer.report(0, 0, 0)
    balancer.report(1, 0, 0)
    assert balancer.choose(PREFIX_B + [11, 12]) == 1  # a tie: B's first block lives on engine 1
    balancer.report(1, 0, 0)
    assert balancer.choose(PREFIX_A) == 0


def test_affinity_never_beats_a_lower_load():
    balancer = LoadBalancer(2, BLOCK)
    assert balancer.choose(PREFIX_A) == 0
    balancer.report(0, num_waiting=3, num_running=1)
    balancer.report(1, num_waiting=0, num_running=1)
    assert balancer.choose(PREFIX_A) == 1


def test_short_prompts_and_other_salts_share_no_block():
    balancer = LoadBalancer(2, BLOCK)
    balancer.report(0, num_waiting=1, num_running=0)  # engine 1 takes the next two
    assert balancer.choose(PREFIX_A, cache_salt="t1") == 1
    balancer.report(1, 0, 0)
    assert balancer.choose(PREFIX_A[: BLOCK - 1]) == 1
    balancer.report(0, 0, 0)
    balancer.report(1, 0, 0)
    assert balancer.choose(PREFIX_A, cache_salt="t1") == 1  # a tie, and the same block: engine 1
    balancer.report(1, 0, 0)
    assert balancer.choose(PREFIX_A, cache_salt="t2") == 0  # another salt is another block
    balancer.report(0, 0, 0)
    assert balancer.choose(PREFIX_A[: BLOCK - 1]) == 0  # shorter than a block: the lowest rank


def test_only_live_engines_are_chosen_and_none_is_an_error():
    balancer = LoadBalancer(3, BLOCK)
    assert balancer.choose([1], live=[2]) == 2
    assert balancer.choose([1], live=[1, 2]) == 1
    with pytest.raises(ValueError, match="no engine"):
        balancer.choose([1], live=[])
    with pytest.raises(ValueError, match="no engine"):
        balancer.choose([1], live=[3])


def test_several_completions_of_one_prompt_count_as_several_requests():
    balancer = LoadBalancer(2, BLOCK)
    assert balancer.choose(PREFIX_A, count=4) == 0
    assert balancer.load(0) == 4
    assert [balancer.choose([1]) for _ in range(4)] == [1, 1, 1, 1]


def test_affinity_memory_is_bounded():
    balancer = LoadBalancer(2, BLOCK, affinity_capacity=2)
    for first in range(5):
        balancer.choose([first] * BLOCK)
    assert len(balancer._affinity) == 2


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_engines"):
        LoadBalancer(0, BLOCK)
