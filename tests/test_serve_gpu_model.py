"""benchmarks/serve_gpu_model.py: the virtual engine against cases whose answer is known.

With a constant step cost c (every other constant 0) the device runs back to back whenever a
request is running, so the engine's timing is that of a deterministic server: a lone request's
first token comes c after it arrives and every later one c apart; under Poisson arrivals into a
busy engine a request waits for the step being collected (c/2 on average: the arrival is uniform
in it), and async scheduling then puts it into the step after the one already in flight (+c)
before its own (+c): 2.5c, against 1.5c with synchronous steps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.dp_gpu_model import build_scheduler
from benchmarks.serve_gpu_model import (
    Arrival,
    StepCost,
    VirtualEngine,
    client_arrivals,
    model_rate,
    parse_args,
    summarize,
)

STEP_MS = 10.0
CONSTANT = StepCost(
    base_ms=STEP_MS,
    gemm_mem_ms=0,
    gemm_mem_row_ms=0,
    gemm_flop_ms=0,
    gemm_flop_row_ms=0,
    decode_ctx_ms=0,
    rest_row_ms=0,
    piecewise_ms=0,
    prefill_token_ms=0,
)


def _engine(sync: bool, budget: int = 2048) -> VirtualEngine:
    args = parse_args(["--max-num-batched-tokens", str(budget)])
    return VirtualEngine(
        build_scheduler(args, async_scheduling=not sync, prefix_caching=True), CONSTANT, 1 if sync else 2, 0.0
    )


@pytest.mark.parametrize("sync", [False, True])
def test_a_lone_request_is_one_step_per_token(sync: bool) -> None:
    engine = _engine(sync)
    engine.run([Arrival(1.0, list(range(100, 164)), 8)], ingress_s=0.0)
    tokens = np.array(engine.times["0"].tokens)
    assert tokens[0] - 1.0 == pytest.approx(STEP_MS / 1000)
    assert np.diff(tokens) == pytest.approx([STEP_MS / 1000] * 7)
    assert len(engine.steps) == 8  # async schedules nothing past the last token in flight


def test_a_long_prompt_is_chunked_by_the_budget() -> None:
    engine = _engine(sync=False, budget=64)
    engine.run([Arrival(0.0, list(range(100, 300)), 2)], ingress_s=0.0)
    assert [s.prefill_tokens for s in engine.steps[:4]] == [64, 64, 64, 8]
    assert engine.times["0"].tokens[0] == pytest.approx(4 * STEP_MS / 1000)


@pytest.mark.parametrize(("sync", "expected_steps"), [(False, 2.5), (True, 1.5)])
def test_poisson_arrivals_into_a_busy_engine_wait_as_computed(sync: bool, expected_steps: float) -> None:
    arrivals = client_arrivals(seed=3, rate=40, num_prompts=400, input_len=32, output_len=32)
    engine = _engine(sync)
    engine.run(arrivals, ingress_s=0.0)
    result = summarize(engine, egress_s=0.0)
    assert result["completed"] == 400
    assert all(len(t.tokens) == 32 for t in engine.times.values())
    # Every request alive at once costs nothing more per step here: the steps stay c apart.
    assert result["itl_ms"]["median"] == pytest.approx(STEP_MS)
    # The first few arrive at an idle engine (TTFT c); the rest as computed, within sampling error.
    assert result["ttft_ms"]["mean"] == pytest.approx(expected_steps * STEP_MS, rel=0.05)


def test_client_arrivals_are_the_clients_poisson_draws() -> None:
    arrivals = client_arrivals(seed=32, rate=32, num_prompts=2000, input_len=256, output_len=256)
    gaps = np.diff([a.time_s for a in arrivals])
    assert np.mean(gaps) == pytest.approx(1 / 32, rel=0.05)
    assert {len(a.prompt) for a in arrivals} == {256}
    assert arrivals[0].time_s == 0.0 and arrivals[1].prompt[0] == (arrivals[1].prompt[1] - 1)


def test_the_default_model_serves_every_request() -> None:
    args = parse_args(["--num-prompts", "60", "--output-len", "32"])
    result = model_rate(args, 32, StepCost())
    assert result["completed"] == 60
    assert result["ttft_ms"]["p99"] >= result["ttft_ms"]["median"] > 0


def test_a_trace_is_compared_step_by_step(tmp_path) -> None:
    """Each call's step is timed by the period that ends with the call that collects it."""
    from benchmarks.serve_gpu_model import compare_trace

    def line(t: float, reqs: int, prefill: int, arrived: int = 0) -> str:
        fields = {"t": t, "gap_s": 0.0, "busy_s": 0.001, "arrived": arrived, "collected": 1, "running": reqs}
        fields |= {"waiting": 0, "step_id": 1, "reqs": reqs, "tokens": reqs + prefill, "prefill_tokens": prefill}
        return json.dumps(fields)

    # An idle engine, then: a mixed step (3 decodes + 256 prefill) taking 20 ms, decodes of 10 ms.
    lines = [line(0.0, 3, 256, arrived=1), line(0.020, 4, 0), line(0.030, 4, 0)]
    (tmp_path / "run.dp0.jsonl").write_text("\n".join(lines) + "\n")
    result = compare_trace(str(tmp_path / "run"), CONSTANT, 384)
    assert result["mixed"]["measured_ms"]["median"] == pytest.approx(20.0)
    assert result["decode"]["measured_ms"]["median"] == pytest.approx(10.0)
    assert result["decode"]["model_ms"]["median"] == pytest.approx(STEP_MS)
    assert result["periods_over_100ms"] == []
