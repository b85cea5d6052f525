"""`vllm-launch -dp 2 --api-server-count 2` with real processes and sockets: two frontends, each
driving its own engine, share one HTTP port (SO_REUSEPORT); completions over fresh connections
are HF's greedy tokens, both frontends serve some, /metrics adds up both frontends' request
counts, SIGTERM drains both and leaves no process behind; bad counts are refused clearly."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.helpers.models import hf_greedy, save_tiny_llama
from tests.helpers.server import ONE_THREAD, processes_gone, start_server, wait_until
from zllm import Client, SamplingParams
from zllm.config import EngineConfig
from zllm.ipc.addresses import api_server_endpoint
from zllm.launch.sd_notify import NotifyRelay

pytestmark = pytest.mark.slow

PROMPTS = [[5 + i, 17, 42 + 3 * i, 99, 7 + i] for i in range(8)]
MAX_TOKENS = 12
LONG_TOKENS = 480  # a stream still running while vllm-launch is stopped (~2 s here)
HTTP_REQUESTS = 24  # over fresh connections: the kernel's spread leaves one frontend none with p = 2^-23


# ---- flags and config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"api_server_count": 2}, "api_server_count: 2 API servers cannot split --data-parallel-size 1 evenly"),
        ({"data_parallel_size": 4, "api_server_count": 3}, "cannot split --data-parallel-size 4 evenly"),
        ({"api_server_count": 0}, "api_server_count: must be >= 1"),
        (
            {"data_parallel_size": 2, "api_server_count": 2, "api_server_rank": 2},
            r"api_server_rank: must be in \[0, 2\)",
        ),
    ],
)
def test_bad_api_server_counts_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", max_model_len=64, **fields).validate()


def test_each_api_server_drives_its_share_of_the_engines():
    ranks = [
        list(EngineConfig(model="m", data_parallel_size=4, api_server_count=2, api_server_rank=k).frontend_dp_ranks)
        for k in range(2)
    ]
    assert ranks == [[0, 1], [2, 3]]
    config = EngineConfig(model="m", tensor_parallel_size=2, data_parallel_size=4, data_parallel_rank=3)
    assert config.first_gpu == 6  # engine 3 keeps its GPUs behind whichever API server drives it
    assert list(EngineConfig(model="m", data_parallel_size=4).frontend_dp_ranks) == [0, 1, 2, 3]


def test_each_api_server_has_its_own_client_endpoint():
    assert api_server_endpoint("ipc:///run/zllm/zllm.sock", 0) == "ipc:///run/zllm/zllm.sock"
    assert api_server_endpoint("ipc:///run/zllm/zllm.sock", 2) == "ipc:///run/zllm/zllm.2.sock"
    assert api_server_endpoint("tcp://10.0.0.1:5555", 3) == "tcp://10.0.0.1:5558"


def test_the_launcher_refuses_a_count_that_does_not_divide_dp(tmp_path):
    tiny = save_tiny_llama(tmp_path / "tiny")
    command = [sys.executable, "-m", "zllm.launch.cli", "--model", str(tiny), "-dp", "3", "--api-server-count", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "api_server_count: 2 API servers cannot split --data-parallel-size 3 evenly" in done.stderr


def test_the_notify_relay_knows_each_sender_by_its_pid(tmp_path):
    """READY=1 / WATCHDOG=1 from real processes over the real socket, told apart by pid."""

    async def scenario() -> tuple[set[int], set[int], bool, bool]:
        relay = NotifyRelay(str(tmp_path / "notify"))
        env = {**os.environ, "NOTIFY_SOCKET": relay.path}
        send = "from zllm.launch.sd_notify import SystemdNotifier as N; n = N(); n.ready('up'); n.watchdog()"
        children = [subprocess.Popen([sys.executable, "-c", send], env=env) for _ in range(2)]
        pids = {child.pid for child in children}
        await asyncio.wait_for(relay.wait_ready(pids), 60)
        await asyncio.wait_for(asyncio.to_thread(lambda: [child.wait() for child in children]), 60)
        await asyncio.sleep(0.1)  # the reader callback of the last datagrams
        fed = relay.take_watchdog(pids)
        fed_again = relay.take_watchdog(pids)  # nothing since: no WATCHDOG=1 to pass on
        relay.close()
        return pids, relay.ready, fed, fed_again

    pids, ready, fed, fed_again = asyncio.run(scenario())
    assert ready == pids and fed and not fed_again


# ---- served ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def hf_tokens(tiny) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype="float32")
    return [hf_greedy(model, prompt, MAX_TOKENS, eos_token_id=None) for prompt in PROMPTS]


def _queries(endpoint: str) -> dict[int, int]:
    """Prompt tokens looked up so far by each engine of the frontend behind this endpoint."""
    with Client(endpoint, timeout=60) as client:
        return {engine["dp_rank"]: engine["prefix_cache_queries"] for engine in client.stats()["engines"]}


def _complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)  # a fresh connection each time


def test_two_api_servers_share_the_port_and_serve_hf_tokens(tmp_path, tiny, hf_tokens):
    server = start_server(
        tmp_path, tiny, "-dp", "2", "--api-server-count", "2", "--dtype", "float32", "--max-model-len", "512",
        env=ONE_THREAD,
    )  # fmt: skip
    endpoints = [api_server_endpoint(server.endpoint, rank) for rank in range(2)]
    try:
        descendants = server.children()
        frontends = [p for p in descendants if "zllm.launch.api_server_process" in " ".join(p.cmdline())]
        assert len(frontends) == 2 and all(p.ppid() == server.process.pid for p in frontends)
        assert "(2 API servers, 2 data-parallel engines)" in server.log()
        # Each frontend's client endpoint: its own engine, HF's tokens.
        texts = {}
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            with Client(endpoints[i % 2], timeout=120) as client:
                output = client.generate(prompt_token_ids=prompt, sampling_params=greedy).outputs[0]
            assert list(output.token_ids) == hf_tokens[i]
            texts[i] = output.text
        assert [list(_queries(e)) for e in endpoints] == [[0], [1]]
        before = [_queries(e) for e in endpoints]

        with ThreadPoolExecutor(8) as pool:
            indices = [i % len(PROMPTS) for i in range(HTTP_REQUESTS)]
            responses = list(pool.map(lambda i: _complete(server.http_url, PROMPTS[i]), indices))
        assert [r.status_code for r in responses] == [200] * HTTP_REQUESTS
        assert [r.json()["choices"][0]["text"] for r in responses] == [texts[i] for i in indices]
        after = [_queries(e) for e in endpoints]
        # Frontend k drives engine k alone: its engine's lookups grew only if it took HTTP requests.
        assert after[0][0] > before[0][0] and after[1][1] > before[1][1], (before, after)

        # Any frontend's /metrics adds up both frontends' requests (prometheus multiprocess mode).
        metrics = httpx.get(server.http_url + "/metrics", timeout=30).text
        finished = re.search(
            r'^zllm:request_success_total{finished_reason="length",model_name="[^"]+"} (\S+)$', metrics, re.M
        )
        assert finished and float(finished.group(1)) == len(PROMPTS) + HTTP_REQUESTS, metrics
        # SIGTERM to vllm-launch drains both frontends: a stream in flight on frontend 0 goes on
        # to its end. A unit with KillMode=control-group signals frontend 0 itself too, and a
        # repeated signal must not turn its drain into a stop.
        long = SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True)
        with Client(endpoints[0], timeout=120) as client:
            stream = client.stream(prompt_token_ids=PROMPTS[0], sampling_params=long)
            streamed = list(next(stream).outputs[0].token_ids)
            server.process.terminate()
            assert wait_until(lambda: "draining 1 request(s)" in server.log(), 10), server.log()[-2000:]
            frontend0 = int(re.search(r"frontend0\[(\d+)\]", server.log()).group(1))
            assert frontend0 in [p.pid for p in frontends]
            psutil.Process(frontend0).terminate()
            assert wait_until(lambda: "SIGTERM again: already draining" in server.log(), 10), server.log()[-2000:]
            streamed += [token for delta in stream for token in delta.outputs[0].token_ids]
        assert len(streamed) == LONG_TOKENS and streamed[:MAX_TOKENS] == hf_tokens[0]
        code = server.process.wait(60)
    finally:
        server.stop()  # a no-op once it has exited
    assert code == 0, server.log()[-3000:]
    assert wait_until(lambda: processes_gone([p.pid for p in descendants]), 30), [
        p for p in descendants if psutil.pid_exists(p.pid)
    ]
    assert server.log().count("drained: shutting down") == 2


def test_a_frontend_that_dies_stops_the_others(tmp_path, tiny):
    server = start_server(
        tmp_path, tiny, "-dp", "2", "--api-server-count", "2", "--max-model-len", "512", env=ONE_THREAD
    )
    try:
        descendants = server.children()
        victim = next(p for p in descendants if "zllm.launch.api_server_process" in " ".join(p.cmdline()))
        victim.kill()
        code = server.process.wait(60)
    finally:
        server.stop()
    assert code == 1
    assert re.search(
        rf"api server \d \(pid {victim.pid}\) exited with code -9 \(SIGKILL\): stopping the others", server.log()
    )
    assert wait_until(lambda: processes_gone([p.pid for p in descendants]), 30), [
        p for p in descendants if psutil.pid_exists(p.pid)
    ]
