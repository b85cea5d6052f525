"""The engine as real processes: frontend (vllm-launch) -> engine core -> worker, over ZeroMQ.
(Engine failures and recovery: tests/test_reliability.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.models import hf_greedy
from tests.helpers.server import processes_gone, start_server, wait_until
from zllm import AsyncClient, Client, LLMEngine, SamplingParams
from zllm.client import RequestError, ServerGoneError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:\n1.",
    " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(30)) + "\nSummary:",
]


def _quiescent(client: Client) -> bool:
    stats = client.stats()
    return (
        stats["num_running"] == 0
        and stats["num_waiting"] == 0
        and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    )


def test_outputs_equal_inprocess_engine_and_hf(server, smollm2_dir, smollm2_tokenizer, hf_smollm2):
    with Client(server.endpoint) as client:
        remote = [client.generate(p, GREEDY) for p in PROMPTS]
        chat = client.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    engine = LLMEngine.from_engine_args(smollm2_dir, dtype="float32")
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    local = {}
    while engine.has_unfinished_requests():
        local.update({o.request_id: o for o in engine.step() if o.finished})
    eos = hf_smollm2.generation_config.eos_token_id
    for i, out in enumerate(remote):
        ids = smollm2_tokenizer.encode(PROMPTS[i])
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == local[str(i)].outputs[0].token_ids == hf_greedy(hf_smollm2, ids, 16, eos)
        assert out.outputs[0].text == local[str(i)].outputs[0].text
    assert "Paris" in chat.outputs[0].text


def test_32_streams_on_one_client_cancel_half(server):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [f"Story number {i}: once upon a time" for i in range(32)]

    async def scenario():
        async with AsyncClient(server.endpoint) as client:
            expected = await asyncio.gather(*[client.generate(p, params) for p in prompts[::2]])

            async def consume(i: int):
                tokens = []
                async for delta in client.stream(prompts[i], params):
                    tokens.extend(delta.outputs[0].token_ids)
                    if i % 2 == 1 and len(tokens) >= 3:
                        break  # leaving the stream aborts the request server-side
                return tokens

            got = await asyncio.gather(*[consume(i) for i in range(32)])
            return [e.outputs[0].token_ids for e in expected], got

    expected, got = asyncio.run(scenario())
    assert got[::2] == expected
    assert all(3 <= len(tokens) < 24 for tokens in got[1::2])
    with Client(server.endpoint) as client:
        assert wait_until(lambda: _quiescent(client), timeout=10)


def test_bad_client_input_fails_alone(server):
    bad_requests = [
        (dict(prompt="Hi", sampling_params=SamplingParams(max_tokens=4)), None),  # control: fine
        (dict(prompt="word " * 9000), "prompt"),
        (dict(prompt=""), "prompt"),
        (dict(prompt="Hi", prompt_token_ids=[1, 2]), "prompt"),
        (dict(prompt_token_ids=[1, 10**9]), "prompt_token_ids"),
    ]

    async def scenario():
        async with AsyncClient(server.endpoint) as client:
            good = asyncio.create_task(client.generate("The capital of France is", GREEDY))
            errors = []
            for kwargs, _field in bad_requests:
                try:
                    await client.generate(**kwargs)
                    errors.append(None)
                except RequestError as error:
                    errors.append(str(error))
            # Sampling fields arrive as a map: unknown names and wrong types are rejected too.
            for sampling in ({"temperature": -1}, {"temprature": 0.5}, {"max_tokens": "many"}):
                client._ensure_started()
                from zllm.ipc.messages import ClientGenerate

                stream = client._stream(ClientGenerate(request_id=f"raw-{len(errors)}", prompt="Hi", sampling=sampling))
                try:
                    async for _ in stream:
                        pass
                    errors.append(None)
                except RequestError as error:
                    errors.append(str(error))
            return await good, errors

    good, errors = asyncio.run(scenario())
    assert errors[0] is None
    for (_, field), message in zip(bad_requests[1:], errors[1:5]):
        assert message is not None and message.startswith(f"{field}:"), message
    assert "temperature" in errors[5] and "temprature" in errors[6] and "max_tokens" in errors[7]
    with Client(server.endpoint) as client:
        assert good.outputs[0].token_ids == client.generate("The capital of France is", GREEDY).outputs[0].token_ids


def test_vanished_client_requests_are_aborted(server):
    script = (
        "import sys; from zllm import Client, SamplingParams\n"
        "c = Client(sys.argv[1])\n"
        "for d in c.stream('Count forever:', SamplingParams(max_tokens=4000, ignore_eos=True)):\n"
        "    print('token', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, server.endpoint], stdout=subprocess.PIPE)
    assert child.stdout.readline().startswith(b"token")
    with Client(server.endpoint) as client:
        assert client.stats()["num_running"] >= 1
        child.kill()
        child.wait()
        assert wait_until(lambda: _quiescent(client), timeout=10)


def test_server_gone_is_a_clear_error(tmp_path):
    client = Client(f"ipc://{tmp_path}/nobody.sock", timeout=2.0, heartbeat_interval=0.2)
    started = time.monotonic()
    with pytest.raises(ServerGoneError):
        client.generate("Hi", GREEDY)
    assert time.monotonic() - started < 10
    client.close()


def test_client_import_is_light():
    code = (
        "import sys; from zllm import Client, AsyncClient, SamplingParams\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_shutdown_leaves_no_process(tmp_path, smollm2_dir):
    handle = start_server(tmp_path, smollm2_dir)
    pids = [p.pid for p in handle.children()]
    assert len(pids) >= 2  # engine core + worker
    with Client(handle.endpoint) as client:
        assert client.generate("Hi", GREEDY).finished
    assert handle.stop() == 0
    assert wait_until(lambda: processes_gone(pids), timeout=10)
    assert not os.path.exists(handle.runtime_dir) or not os.listdir(handle.runtime_dir)


def test_kill9_frontend_children_exit_by_themselves(tmp_path, smollm2_dir):
    handle = start_server(tmp_path, smollm2_dir)
    pids = [p.pid for p in handle.children()]
    os.kill(handle.process.pid, signal.SIGKILL)
    handle.process.wait()
    assert wait_until(lambda: processes_gone(pids), timeout=10), [
        psutil.Process(p).status() for p in pids if psutil.pid_exists(p)
    ]


def test_debug_hang_env_makes_a_child_dump_every_threads_stack():
    """ZLLM_DEBUG_HANG_S=N: a process stuck somewhere prints where, every N seconds, to stderr."""
    code = (
        "import time; from zllm.procs.children import install_hang_dump\n"
        "install_hang_dump()\n"
        "def stuck_in_a_collective(): time.sleep(2.5)\n"
        "stuck_in_a_collective()\n"
    )
    env = dict(os.environ, ZLLM_DEBUG_HANG_S="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stderr.count("stuck_in_a_collective") >= 2, result.stderr  # dumped at 1 s and 2 s
    quiet = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, ZLLM_DEBUG_HANG_S=""),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "stuck_in_a_collective" not in quiet.stderr
