"""ZLLM_STEP_TRACE: each engine core and each worker write one JSON line per step, and the lines
account for the work exactly (every request arrives once, every prompt and output token is
scheduled once, every output token comes back; the worker advanced exactly the steps its core
submitted); off, nothing is opened."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.helpers.models import save_tiny_llama
from zllm import LLM, SamplingParams
from zllm.enginecore.step_trace import StepTrace
from zllm.step_trace import TraceFile


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny")))


def _workload(count: int, seed: int = 0) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(rng.randint(5, 40))]} for _ in range(count)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 12), ignore_eos=True) for _ in range(count)]
    return prompts, params


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_accounts_for(lines: list[dict], prompts: list[dict], params: list[SamplingParams]) -> None:
    """The engine's lines hold exactly these requests' work (no prefix cache hits: random prompts)."""
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    outputs = sum(p.max_tokens for p in params)
    assert sum(line["arrived"] for line in lines) == len(prompts)
    assert sum(line.get("new", 0) for line in lines) == len(prompts)
    # A request computes its prompt and every output token but the last, which is only sampled.
    assert sum(line.get("tokens", 0) for line in lines) == prompt_tokens + outputs - len(prompts)
    assert sum(line["deltas"] for line in lines) == outputs
    assert sum(line["finished"] for line in lines) == len(prompts)
    assert [line["running"] + line["waiting"] for line in lines[-1:]] == [0]
    assert all(line["busy_s"] >= line["wait_s"] >= 0 and line["gap_s"] >= 0 for line in lines)
    arrivals = [line for line in lines if line["arrived"]]
    assert all(line["arrived_t0"] <= line["arrived_t1"] <= line["t"] for line in arrivals)


def _assert_worker_advanced_the_cores_steps(worker: list[dict], core: list[dict]) -> None:
    submitted = [line for line in core if "reqs" in line]
    assert [(w["step_id"], w["rows"], w["tokens"]) for w in worker] == [
        (c["step_id"], c["reqs"], c["tokens"]) for c in submitted
    ]
    assert all(w["busy_s"] >= w["launch_s"] + w["finish_s"] + w["sample_s"] - 1e-5 for w in worker)
    assert all(0 <= w["sync_s"] <= w["finish_s"] for w in worker)


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("ZLLM_STEP_TRACE", raising=False)
    assert StepTrace.from_env(0) is None
    assert TraceFile.open("dp0.worker0") is None


def test_in_process_engine_traces_every_step(tiny_model, tmp_path, monkeypatch):
    prefix = tmp_path / "trace"
    monkeypatch.setenv("ZLLM_STEP_TRACE", str(prefix))
    prompts, params = _workload(24)
    with LLM(tiny_model, dtype="float32", max_num_batched_tokens=128, max_num_seqs=8) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [p.max_tokens for p in params]
    lines = _lines(Path(f"{prefix}.dp0.jsonl"))
    _assert_accounts_for(lines, prompts, params)
    _assert_worker_advanced_the_cores_steps(_lines(Path(f"{prefix}.dp0.worker0.jsonl")), lines)
    submitted = [line for line in lines if "reqs" in line]
    assert max(line["reqs"] for line in submitted) == 8  # max_num_seqs, reached
    assert max(line["tokens"] for line in submitted) <= 128  # the budget
    assert max(line["waiting"] for line in lines) > 0


@pytest.mark.slow
def test_each_data_parallel_engine_traces_its_own_requests(tiny_model, tmp_path, monkeypatch):
    prefix = tmp_path / "trace"
    monkeypatch.setenv("ZLLM_STEP_TRACE", str(prefix))  # the engine-core processes inherit it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prompts, params = _workload(16, seed=1)
    with LLM(tiny_model, dtype="float32", data_parallel_size=2) as llm:
        llm.generate(prompts, params, use_tqdm=False)
    per_engine = [_lines(Path(f"{prefix}.dp{rank}.jsonl")) for rank in (0, 1)]
    assert [sum(line["arrived"] for line in lines) for lines in per_engine] == [8, 8]  # least loaded: alternates
    total = [line for lines in per_engine for line in lines]
    _assert_accounts_for(total, prompts, params)
    assert {line["dp"] for line in per_engine[1]} == {1}
    for rank, lines in enumerate(per_engine):
        _assert_worker_advanced_the_cores_steps(_lines(Path(f"{prefix}.dp{rank}.worker0.jsonl")), lines)
