"""A request that fails on the workers fails alone: its client gets an error, every other request
in the same batch completes exactly as without it, and the engine is not restarted.

The failure is injected with the test-only ZLLM_TEST_FAIL_PROMPT_TOKEN hook (a worker admitting a
request whose prompt holds that token raises). The failing request comes first in its batch, so
the others take its prefix blocks from the cache in the same step: blocks the workers never
computed. They must be recomputed, or their outputs would differ from the reference.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers.models import save_tiny_llama
from tests.helpers.server import ONE_THREAD, engine_processes, start_server
from tests.helpers.streams import Ended, run_streams
from zllm import Client, SamplingParams
from zllm.client import RequestFailedError

POISON = 77
SHARED = [5 + i % 50 for i in range(40)]  # two and a half blocks of 16, shared by every prompt
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
NUM_OTHERS = 15


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny"), initializer_range=0.2, max_position_embeddings=4096))


# ---- in process (tp 1: the worker in this process; tp 2: two worker processes over gloo) ----------


@pytest.mark.parametrize("tp, async_scheduling", [(1, False), (2, False), (1, True), (2, True)])
def test_failed_request_fails_alone_in_process(tiny_model, monkeypatch, tp, async_scheduling):
    import torch

    from zllm import LLM

    monkeypatch.setenv("ZLLM_TEST_FAIL_PROMPT_TOKEN", str(POISON))  # read by each worker when it starts
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(
        tiny_model,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=16 << 20,
        tensor_parallel_size=tp,
        async_scheduling=async_scheduling,
    )
    try:
        others = [{"prompt_token_ids": SHARED + [60 + i, 61 + i]} for i in range(NUM_OTHERS)]
        outputs = llm.generate([{"prompt_token_ids": SHARED + [POISON]}] + others, GREEDY, use_tqdm=False)
        assert llm.engine.core.stats().num_preemptions == NUM_OTHERS  # they had read its blocks: recomputed
        llm.reset_prefix_cache()
        reference = llm.generate(others, GREEDY, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": [POISON, 5]}, others[0]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
        torch.set_num_threads(threads)

    failed = outputs[0].outputs[0]
    assert outputs[0].finished and failed.finish_reason == "error" and failed.token_ids == []
    assert [o.outputs[0].token_ids for o in outputs[1:]] == [o.outputs[0].token_ids for o in reference]
    assert all(len(o.outputs[0].token_ids) == 12 for o in reference)
    assert again[0].outputs[0].finish_reason == "error"  # the engine went on serving
    assert again[1].outputs[0].token_ids == reference[0].outputs[0].token_ids


# ---- a real server -------------------------------------------------------------------------------


def _text(token_ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in token_ids)  # the placeholder tokenizer's words


def test_failed_request_fails_alone_on_a_live_server(tmp_path, tiny_model):
    handle = start_server(tmp_path, tiny_model, env={"ZLLM_TEST_FAIL_PROMPT_TOKEN": str(POISON), **ONE_THREAD})
    try:
        core, workers = engine_processes(handle)
        pids = [core.pid] + [w.pid for w in workers]
        others = [_text(SHARED + [60 + i, 61 + i]) for i in range(NUM_OTHERS)]
        poisoned = _text(SHARED + [POISON])

        results, _ = asyncio.run(run_streams(handle.endpoint, [poisoned] + others, GREEDY))
        with Client(handle.endpoint) as client:
            client.reset_prefix_cache()
        reference, _ = asyncio.run(run_streams(handle.endpoint, others, GREEDY))

        assert isinstance(results[0], Ended) and isinstance(results[0].error, RequestFailedError), results[0]
        message = str(results[0].error)
        assert (
            message.startswith("the engine failed this request: InjectedFaultError")
            and "ZLLM_TEST_FAIL_PROMPT_TOKEN" in message
        )
        assert results[1:] == reference and all(len(r.tokens) == 12 for r in reference)

        _check_http_errors(handle.http_url, poisoned, others[0], reference[0].text)

        core_now, workers_now = engine_processes(handle)
        assert [core_now.pid] + [w.pid for w in workers_now] == pids  # no restart
        log = handle.log()
        assert "engine failure" not in log and "restarting the engine" not in log
        assert "failed on this worker and was dropped: InjectedFaultError" in log
    finally:
        handle.stop()


def _check_http_errors(url: str, poisoned: str, good: str, good_text: str) -> None:
    body = dict(model=None, max_tokens=12, temperature=0.0, ignore_eos=True)
    with httpx.Client(base_url=url, timeout=60) as http:
        failed = http.post("/v1/completions", json={**body, "prompt": poisoned})
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal"
        assert error["message"].startswith("the engine failed this request: InjectedFaultError")

        streamed = http.post("/v1/completions", json={**body, "prompt": poisoned, "stream": True})
        events = [line[len("data: ") :] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and events[-1] == "[DONE]", streamed.text
        assert '"code":"internal"' in events[-2] and "InjectedFaultError" in events[-2]

        ok = http.post("/v1/completions", json={**body, "prompt": good})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == good_text
