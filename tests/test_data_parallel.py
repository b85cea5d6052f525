"""Data parallelism with real processes: `vllm-launch --data-parallel-size 2` serves 32 streams
exactly as one engine does, on both engines; kill -9 of one engine's worker under load restarts
that engine alone (its streams complete as if nothing happened) while the other engine's streams
go on without a pause; `LLM(data_parallel_size=2)` equals `LLM()`; flags and stats merging."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import psutil
import pytest

from tests.helpers.models import save_tiny_llama
from tests.helpers.server import processes_gone, start_server
from zllm import LLM, AsyncClient, Client, SamplingParams
from zllm.config import EngineConfig
from zllm.frontend.engine_calls import merge_engine_stats
from zllm.launch.args import engine_kwargs
from zllm.launch.cli import build_parser

pytestmark = pytest.mark.slow

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
NUM_STREAMS = 32
PROMPTS = [f"Story number {i}: once upon a time" for i in range(NUM_STREAMS)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# ---- flags, config, stats ------------------------------------------------------------------------


def test_dp_flags_reach_the_config():
    for flag in ("-dp", "--dp", "--data-parallel-size"):
        args = build_parser().parse_args([flag, "3", "--tp", "2"])
        assert engine_kwargs(args)["data_parallel_size"] == 3


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"data_parallel_size": 0}, "data_parallel_size: must be >= 1"),
        ({"data_parallel_size": 2, "data_parallel_rank": 2}, r"data_parallel_rank: must be in \[0, 2\)"),
        (
            {"data_parallel_size": 2, "distributed_init_method": "tcp://127.0.0.1:29500"},
            "distributed_init_method: cannot be shared by several data-parallel engines",
        ),
    ],
)
def test_bad_dp_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", max_model_len=64, **fields).validate()


def test_each_engine_takes_its_own_gpus():
    assert [
        EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=3, data_parallel_rank=r).first_gpu
        for r in range(3)
    ] == [0, 2, 4]


def test_stats_of_several_engines_merge_into_one_view():
    merged = merge_engine_stats(
        {
            1: {
                "num_running": 3,
                "num_waiting": 1,
                "kv_cache_usage": 0.5,
                "prefix_cache_queries": 30,
                "prefix_cache_hits": 10,
                "prefix_cache_hit_rate": 1 / 3,
            },
            0: {
                "num_running": 2,
                "num_waiting": 0,
                "kv_cache_usage": 0.25,
                "prefix_cache_queries": 10,
                "prefix_cache_hits": 10,
                "prefix_cache_hit_rate": 1.0,
            },
        }
    )
    assert merged["num_running"] == 5 and merged["num_waiting"] == 1
    assert merged["kv_cache_usage"] == pytest.approx(0.375)
    assert merged["prefix_cache_hit_rate"] == pytest.approx(0.5)  # 20 of 40, not the mean of the rates
    assert [e["dp_rank"] for e in merged["engines"]] == [0, 1] and merged["engines"][1]["num_running"] == 3


# ---- offline -------------------------------------------------------------------------------------


def test_llm_with_two_engines_equals_one(smollm2_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with LLM(smollm2_dir, max_model_len=512) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:12], GREEDY, use_tqdm=False)]
    with LLM(smollm2_dir, max_model_len=512, data_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS[:12], GREEDY, use_tqdm=False)
        per_engine = llm.engine.core.stats()
        assert llm.reset_prefix_cache()
        pids = [core.processes.core.pid for core in llm.engine.core.cores]
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert [s["prefix_cache_queries"] > 0 for s in per_engine] == [True, True]  # both engines served
    assert processes_gone(pids)


# ---- served: 32 streams, dp 2 vs dp 1 ------------------------------------------------------------


async def _stream_all(endpoint: str, prompts: list[str], params: SamplingParams, on_progress=None):
    """Stream every prompt at once; per stream: (token ids, text, arrival time of each delta)."""
    async with AsyncClient(endpoint, timeout=120) as client:

        async def consume(i: int):
            tokens, text, times = [], "", []
            async for delta in client.stream(prompts[i], params):
                tokens += delta.outputs[0].token_ids
                text += delta.outputs[0].text
                times.append(time.monotonic())
                if on_progress is not None:
                    on_progress(i, len(tokens))
            return tokens, text, times

        return await asyncio.gather(*[consume(i) for i in range(len(prompts))])


def _engine_cores(handle) -> list[psutil.Process]:
    cores = [p for p in handle.children() if "zllm.enginecore.process" in " ".join(p.cmdline())]
    return sorted(cores, key=lambda p: p.create_time())


@pytest.fixture(scope="module")
def dp_servers(tmp_path_factory, smollm2_dir):
    one = start_server(tmp_path_factory.mktemp("dp1"), smollm2_dir, env=ONE_THREAD)
    two = start_server(tmp_path_factory.mktemp("dp2"), smollm2_dir, "--data-parallel-size", "2", env=ONE_THREAD)
    yield one, two
    one.stop()
    two.stop()


def test_two_engines_serve_32_streams_exactly_as_one(dp_servers):
    one, two = dp_servers
    reference = asyncio.run(_stream_all(one.endpoint, PROMPTS, GREEDY))
    results = asyncio.run(_stream_all(two.endpoint, PROMPTS, GREEDY))
    assert [r[:2] for r in results] == [r[:2] for r in reference]
    assert all(len(tokens) == 8 for tokens, _, _ in results)
    with Client(two.endpoint) as client:
        stats = client.stats()
    engines = stats["engines"]
    assert [e["dp_rank"] for e in engines] == [0, 1]
    assert all(e["prefix_cache_queries"] > 0 for e in engines), engines  # both engines took requests
    assert stats["prefix_cache_queries"] == sum(e["prefix_cache_queries"] for e in engines)
    assert "(2 data-parallel engines)" in two.log()


def test_one_metrics_view_with_a_series_per_engine(dp_servers):
    _, two = dp_servers
    text = httpx.get(two.http_url + "/metrics").text
    for rank in ("0", "1"):
        assert re.search(rf'^zllm:prefix_cache_queries_total{{.*dp_rank="{rank}".*}} [1-9]', text, re.M), text
        assert re.search(rf'^zllm:num_requests_running{{.*dp_rank="{rank}".*}} ', text, re.M)
    assert httpx.get(two.http_url + "/health").status_code == 200


# ---- kill -9 of one engine's worker under load ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    directory = save_tiny_llama(tmp_path_factory.mktemp("tiny"), initializer_range=0.2, max_position_embeddings=4096)
    return str(directory)


def test_kill9_of_one_engines_worker_restarts_that_engine_alone(tmp_path, tiny_model):
    handle = start_server(tmp_path, tiny_model, "-dp", "2", "--max-num-seqs", "64", env=ONE_THREAD)
    try:
        prompts = [f"t{3 + i} t{40 + i} t{90 + i}" for i in range(NUM_STREAMS)]
        params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        reference = asyncio.run(_stream_all(handle.endpoint, prompts, params))

        counts = [0] * NUM_STREAMS
        victim_core = _engine_cores(handle)[1]
        victim_pids = [victim_core.pid] + [w.pid for w in victim_core.children()]
        survivor_pid = _engine_cores(handle)[0].pid
        killed_at: list[float] = []

        def kill_once_all_are_streaming(i: int, count: int) -> None:
            counts[i] = count
            if not killed_at and min(counts) >= 20:
                killed_at.append(time.monotonic())
                victim_core.children()[0].kill()

        results = asyncio.run(_stream_all(handle.endpoint, prompts, params, kill_once_all_are_streaming))
        log = handle.log()
        survivor_untouched = psutil.pid_exists(survivor_pid) and _engine_cores(handle)[0].pid == survivor_pid
    finally:
        handle.stop()

    assert [r[:2] for r in results] == [r[:2] for r in reference]  # every stream, token for token
    recovered = re.search(r"engine 1 recovered in ([0-9.]+) s: (\d+) request\(s\) replayed", log)
    assert recovered, log
    assert "engine 1 failure: worker rank 0" in log and "engine 0 failure" not in log
    assert processes_gone(victim_pids) and survivor_untouched  # engine 1 alone was restarted
    recovery_s, replayed = float(recovered.group(1)), int(recovered.group(2))
    # The killed engine's streams wait out its restart; the other engine's keep streaming.
    kill = killed_at[0]
    window = (kill + 0.1, kill + recovery_s - 0.1)
    # A survivor's stream may also have finished before the window opened: it neither paused nor
    # streamed during the restart (seen under a loaded CI machine, where the router had put most
    # streams on the survivor).
    streaming = [times for _, _, times in results if any(window[0] < t < window[1] for t in times)]
    done_before = [times for _, _, times in results if times[-1] <= window[0]]
    paused = [
        times for _, _, times in results if times[-1] >= window[1] and not any(window[0] < t < window[1] for t in times)
    ]
    assert len(paused) == replayed, (len(paused), replayed)
    assert len(streaming) + len(done_before) == NUM_STREAMS - replayed and streaming, (len(streaming), len(done_before))
    step_gaps = [b - a for times in streaming for a, b in zip(times, times[1:]) if b < kill]
    typical_step = sorted(step_gaps)[len(step_gaps) // 2]
    longest = max(b - a for times in streaming for a, b in zip(times, times[1:]) if window[0] < b < window[1])
    print(
        f"recovery {recovery_s:.2f} s; survivor step {typical_step * 1e3:.1f} ms typical, "
        f"{longest * 1e3:.1f} ms longest during the recovery"
    )
    # Measured here: a 3.0 s restart while the survivor's longest gap was 8 ms (4.3 ms typical).
    assert longest < min(0.25, recovery_s / 10), (longest, typical_step, recovery_s)


def test_llm_with_two_engines_names_an_engine_that_died(tiny_model, monkeypatch):
    """Offline there is no supervision: a core that dies fails the call with an error naming it,
    and shutting the LLM down leaves no process behind."""
    from zllm.frontend.core_client import CoreClientError

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    llm = LLM(tiny_model, max_model_len=512, data_parallel_size=2)
    try:
        cores = llm.engine.core.cores
        pids = [c.processes.core.pid for c in cores] + [
            p.pid for c in cores for p in psutil.Process(c.processes.core.pid).children()
        ]
        cores[1].processes.core.kill()
        cores[1].processes.core.wait()
        time.sleep(0.5)  # the PUSH socket has seen the peer go: a blocking send would wait forever
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        with pytest.raises(CoreClientError, match="engine 1"):
            llm.generate([f"t{5 + i} t9" for i in range(8)], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert processes_gone(pids)
