"""The OpenAI-compatible HTTP API of a real `vllm-launch` process, through the official `openai`
package and through plain HTTP (httpx) where the wire format itself is the point."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers.server import start_server
from zllm import Client, SamplingParams

pytestmark = pytest.mark.slow

# NOTE: on a small shared CPU, torch's spinning intra-op threads slow each other down many times
# over (a 2-thread matmul measured 20x slower than 1 thread under load); one thread keeps the
# tests' engine steps fast. Outputs are compared within one server, so the setting cannot matter.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"
BODY_LIMIT = 64 * 1024
FRANCE = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory, smollm2_dir):
    handle = start_server(
        tmp_path_factory.mktemp("api"),
        smollm2_dir,
        "--api-key",
        API_KEY,
        "--max-request-body",
        str(BODY_LIMIT),
        env=ONE_THREAD,
    )
    assert handle.http_url.startswith("http://127.0.0.1:")
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def together(*calls):
    """Run the calls at once, so their requests share engine steps (the CPU is slow); results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def post(api, path: str, body: bytes | dict, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(api.http_url + path, content=content, headers=AUTH if headers is None else headers, timeout=120)


# ---- completions ----------------------------------------------------------------------------------


def test_completion_equals_the_engine_output(api, client, smollm2_tokenizer):
    # The engine's output through the ZMQ client is checked against HF transformers elsewhere.
    params = SamplingParams(temperature=0, max_tokens=8)
    with Client(api.endpoint, api_key=API_KEY) as zmq_client:  # --api-key guards ZMQ too
        out, reference = together(
            lambda: client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=8, temperature=0),
            lambda: zmq_client.generate(FRANCE, params),
        )
    expected = reference.outputs[0]
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == expected.finish_reason
    prompt_tokens = len(smollm2_tokenizer.encode(FRANCE))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, len(expected.token_ids))
    assert out.usage.total_tokens == prompt_tokens + len(expected.token_ids)


def test_prompt_forms_usage_and_echo(client, smollm2_tokenizer):
    texts = ["Once upon a time", "def add(a, b):"]
    ids = [smollm2_tokenizer.encode(t) for t in texts]
    greedy = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    by_text, by_ids, one_ids, echoed = together(
        lambda: client.completions.create(prompt=texts, **greedy),
        lambda: client.completions.create(prompt=ids, **greedy),
        lambda: client.completions.create(prompt=ids[0], **greedy),
        lambda: client.completions.create(prompt=texts[1], echo=True, **greedy),
    )
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert one_ids.choices[0].text == by_text.choices[0].text
    assert by_text.usage.prompt_tokens == sum(len(i) for i in ids)
    assert by_text.usage.completion_tokens == 8
    assert echoed.choices[0].text == texts[1] + by_text.choices[1].text


def test_streaming_completion_equals_the_whole(client):
    args = dict(model=MODEL, prompt="List three colors:", max_tokens=10, temperature=0)
    whole, stream = together(
        lambda: client.completions.create(**args),
        lambda: list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args)),
    )
    chunks = stream
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_cuts_the_text(client):
    args = dict(model=MODEL, prompt="Count: one, two, three, four,", max_tokens=10, temperature=0)
    full = client.completions.create(**args).choices[0].text
    stop = full.split(",")[1] + ","  # a piece the greedy continuation really contains
    cut, streamed = together(
        lambda: client.completions.create(stop=[stop], **args).choices[0],
        lambda: "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **args)),
    )
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop
    assert streamed == cut.text


def test_seed_makes_sampling_repeat(client):
    args = dict(model=MODEL, prompt="Write a word:", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    first, again, one, two = together(
        *[lambda seed=seed: client.completions.create(seed=seed, **args).choices[0].text for seed in (1234, 1234, 1, 2)]
    )
    assert again == first
    assert {one, two} != {first}


def test_n2_gives_two_seeded_choices(client):
    args = dict(
        model=MODEL,
        prompt=["Name a fruit:", "Name a tree:"],
        max_tokens=8,
        temperature=1.0,
        n=2,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    out, again = together(lambda: client.completions.create(**args), lambda: client.completions.create(**args))
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt index * n + sample index
    assert out.choices[0].text != out.choices[1].text  # each sample has its own seed (7, 8)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert out.usage.completion_tokens == 4 * 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(stream=True, **{**args, "prompt": args["prompt"][1]})
        if c.choices and c.choices[0].index == 1
    )
    assert streamed == out.choices[3].text


def test_completion_logprobs_equal_the_engine(api, client):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3)
    with Client(api.endpoint, api_key=API_KEY) as zmq_client:  # --api-key guards ZMQ too
        out, echoed, reference = together(
            lambda: client.completions.create(model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0, logprobs=3),
            lambda: client.completions.create(
                model=MODEL, prompt=FRANCE, max_tokens=4, temperature=0, logprobs=3, echo=True
            ),
            lambda: zmq_client.generate(FRANCE, params),
        )
    expected = reference.outputs[0]
    lp = out.choices[0].logprobs
    # (batched together with other requests, the floats may differ in the last bits)
    close = dict(abs=1e-5)
    assert lp.token_logprobs == pytest.approx(
        [d[t].logprob for t, d in zip(expected.token_ids, expected.logprobs)], **close
    )
    for top, d in zip(lp.top_logprobs, expected.logprobs):
        assert top == pytest.approx({x.decoded_token: x.logprob for x in d.values()}, **close)
    assert all(len(top) == 3 for top in lp.top_logprobs)  # the greedy token is the top-1 of its 3
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    # echo: the prompt's tokens lead, the first without a logprob (nothing precedes it).
    prompt_len = out.usage.prompt_tokens
    echo_lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == FRANCE + out.choices[0].text
    assert len(echo_lp.tokens) == prompt_len + 4 and echo_lp.token_logprobs[0] is None
    assert all(v <= 0 for v in echo_lp.token_logprobs[1:])
    assert echo_lp.token_logprobs[prompt_len:] == pytest.approx(lp.token_logprobs, **close)


def test_penalties_and_vllm_fields_reach_the_engine(api, client):
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5)
    extra = dict(repetition_penalty=1.3, min_tokens=3, top_k=5)
    params = SamplingParams(temperature=0, max_tokens=12, **fields, **extra)
    with Client(api.endpoint, api_key=API_KEY) as zmq_client:  # --api-key guards ZMQ too
        out, plain, reference = together(
            lambda: client.completions.create(
                model=MODEL, prompt="Repeat: la la la la", max_tokens=12, temperature=0, extra_body=extra, **fields
            ),
            lambda: client.completions.create(model=MODEL, prompt="Repeat: la la la la", max_tokens=12, temperature=0),
            lambda: zmq_client.generate("Repeat: la la la la", params),
        )
    assert out.choices[0].text == reference.outputs[0].text
    assert out.choices[0].text != plain.choices[0].text


# ---- chat -----------------------------------------------------------------------------------------


def test_chat_answers_through_the_template(client, smollm2_tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and "Paris" in out.choices[0].message.content
    rendered = smollm2_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert out.usage.prompt_tokens == len(smollm2_tokenizer.encode(rendered, add_special_tokens=False))


def test_chat_streaming(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    whole, chunks = together(
        lambda: client.chat.completions.create(**args),
        lambda: list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args)),
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage == whole.usage


def test_chat_n2_and_logprobs(client):
    args = dict(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0.8,
        n=2,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    out, chunks = together(
        lambda: client.chat.completions.create(**args),
        lambda: list(client.chat.completions.create(stream=True, **args)),
    )
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 12
    for choice in out.choices:
        tokens = choice.logprobs.content
        assert len(tokens) == 6 and "".join(t.token for t in tokens) == choice.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 and bytes(t.bytes).decode() == t.token for t in tokens)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == out.choices[index].message.content
        streamed = [t for c in mine if c.logprobs for t in c.logprobs.content]
        expected = [t.logprob for t in out.choices[index].logprobs.content]
        assert [t.logprob for t in streamed] == pytest.approx(expected, abs=1e-5)  # batched apart: last bits


# ---- errors, auth, wire format --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "%s", "prompt": "Hi", "temperature": NaN}' % MODEL.encode(), 400, None),
        (b'{"prompt": "Hi", "max_tokens": 4', 400, None),  # malformed JSON
        (b"[1, 2]", 400, None),
        ({"prompt": "Hi", "max_tokens": "four"}, 400, "max_tokens"),
        ({"prompt": "Hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "Hi", "stream": "yes"}, 400, "stream"),
        ({"prompt": "Hi", "max_tokens": 2048}, 400, "max_tokens"),  # prompt + max_tokens over the context
        ({"prompt": "word " * 2100, "max_tokens": 1}, 400, "prompt"),
        ({"prompt": "Hi", "n": 100000}, 400, "n"),
        ({"prompt": "Hi", "n": 0}, 400, "n"),
        ({"prompt": "Hi", "logprobs": 1000}, 400, "logprobs"),
        ({"prompt": "Hi", "presence_penalty": 3}, 400, "presence_penalty"),
        ({"prompt": "Hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"prompt": "Hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ({"prompt": [1, "two"]}, 400, "prompt"),
        ({"prompt": [[10**9]]}, 400, "prompt"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "Hi", "temperature": "hot", "temprature": 0.5}, 400, "temperature"),  # the typo is ignored
        ({"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_completion_errors(api, body, status, param):
    response = post(api, "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}], "max_tokens": 4000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": CHAT, "logprobs": True, "top_logprobs": 99}, "logprobs"),
        ({"messages": "hello"}, "messages"),
    ],
)
def test_chat_errors(api, body, param):
    response = post(api, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_error_shapes_through_openai(client):
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=-3)
    assert bad.value.body["param"] == "temperature"


def test_oversized_body_is_413(api):
    response = post(api, "/v1/completions", {"prompt": "x" * (BODY_LIMIT + 1)})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_api_key_guards_v1_routes(api):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            response = httpx.request(method, api.http_url + path, headers=headers, content=b"{}")
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(api.http_url + "/health").status_code == 200  # not a /v1 route
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="wrong", max_retries=0).models.list()


def test_models_version_health(client, api):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == 2048
    assert httpx.get(api.http_url + "/version").json() == {"version": "0.1.0"}
    assert httpx.get(api.http_url + "/health").status_code == 200
    assert httpx.get(api.http_url + "/nowhere").json()["error"]["code"] == "not_found"


def test_sse_wire_format(api):
    body = {"model": MODEL, "prompt": FRANCE, "max_tokens": 6, "temperature": 0, "stream": True}

    def read_stream() -> str:
        with httpx.stream("POST", api.http_url + "/v1/completions", json=body, headers=AUTH, timeout=120) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            return response.read().decode()

    raw, whole = together(read_stream, lambda: post(api, "/v1/completions", {**body, "stream": False}).json())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] is not None
    assert "".join(p["choices"][0]["text"] for p in payloads) == whole["choices"][0]["text"]


def test_metrics_count_requests(api, client):
    def scrape() -> str:
        return httpx.get(api.http_url + "/metrics").text

    def value(text: str, name: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])

    before = scrape()
    out = client.completions.create(
        model=MODEL, prompt=FRANCE, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape()
    assert (
        value(after, "zllm:prompt_tokens_total") - value(before, "zllm:prompt_tokens_total") == out.usage.prompt_tokens
    )
    assert value(after, "zllm:generation_tokens_total") - value(before, "zllm:generation_tokens_total") == 5
    assert (
        value(after, "zllm:time_to_first_token_seconds_count")
        == value(before, "zllm:time_to_first_token_seconds_count") + 1
    )
    assert (
        value(after, "zllm:inter_token_latency_seconds_count") - value(before, "zllm:inter_token_latency_seconds_count")
        == 4
    )
    assert (
        value(after, "zllm:e2e_request_latency_seconds_count")
        == value(before, "zllm:e2e_request_latency_seconds_count") + 1
    )
    for name in (
        "zllm:num_requests_running",
        "zllm:num_requests_waiting",
        "zllm:kv_cache_usage_perc",
        "zllm:num_preemptions_total",
        "zllm:prefix_cache_hits_total",
        "zllm:prefix_cache_queries_total",
    ):
        assert value(after, name) >= 0


# ---- load: 100 streams, half of them dropped by their clients ------------------------------------


def test_100_streams_half_disconnected(api):
    def metric(name: str) -> float:
        text = httpx.get(api.http_url + "/metrics").text
        return float(next(row for row in text.splitlines() if row.startswith(name + "{")).rsplit(" ", 1)[1])

    aborted_before = _aborted(api)

    async def stream(http: httpx.AsyncClient, i: int) -> tuple[int, int | None]:
        keep = i % 2 == 0
        body = {
            "model": MODEL,
            "prompt": f"Story {i}: once upon a time",
            "temperature": 0,
            "stream": True,
            "max_tokens": 4 if keep else 1500,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        events, usage = 0, None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if line == "data: [DONE]":
                    return events, usage
                chunk = json.loads(line[6:])
                usage = chunk["usage"]["completion_tokens"] if chunk["usage"] else None
                if not keep and events == 1:
                    return events, None  # leave: the connection closes mid-stream
        raise AssertionError(f"stream {i} ended without [DONE]")

    async def scenario():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=api.http_url, headers=AUTH, limits=limits, timeout=300) as http:
            return await asyncio.gather(*[stream(http, i) for i in range(100)])

    results = asyncio.run(scenario())
    assert all(usage == 4 for _, usage in results[::2]), results[::2]
    assert all(events == 1 for events, _ in results[1::2])
    # The dropped ones asked for 1500 tokens each: only aborts bring the engine back to idle soon.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (metric("zllm:num_requests_running") or metric("zllm:num_requests_waiting")):
        time.sleep(0.2)
    assert metric("zllm:num_requests_running") == 0 and metric("zllm:num_requests_waiting") == 0
    assert metric("zllm:kv_cache_usage_perc") == 0
    with Client(api.endpoint, api_key=API_KEY) as zmq_client:  # --api-key guards ZMQ too
        stats = zmq_client.stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert _aborted(api) - aborted_before == 50


def test_non_streaming_client_that_leaves_is_aborted(api):
    aborted_before = _aborted(api)
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(api.http_url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(5, read=3))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _aborted(api) == aborted_before:
        time.sleep(0.2)
    assert _aborted(api) == aborted_before + 1
    with Client(api.endpoint, api_key=API_KEY) as zmq_client:  # --api-key guards ZMQ too
        stats = zmq_client.stats()
    assert stats["num_running"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def _aborted(api) -> float:
    text = httpx.get(api.http_url + "/metrics").text
    line = [row for row in text.splitlines() if row.startswith("zllm:request_success_total") and '"abort"' in row]
    return float(line[0].rsplit(" ", 1)[1]) if line else 0.0


# ---- health: 503 when the engine is dead, restarting, or the server drains (in process, no engine) ---


def test_health_and_requests_answer_503_when_dead_or_draining(smollm2_dir):
    from zllm.config import EngineConfig
    from zllm.frontend.openai.api_server import ApiServer
    from zllm.frontend.server import FrontendServer

    async def scenario():
        frontend = FrontendServer(EngineConfig.create(smollm2_dir, port=0, max_model_len=2048))
        api = ApiServer(frontend)
        url = await api.start()
        answers = []
        try:
            async with httpx.AsyncClient(base_url=url) as http:
                for state in ("serving", "dead", "draining", "recovering"):
                    frontend.dead_reason = "worker 0 exited" if state == "dead" else None
                    frontend.draining = state == "draining"
                    frontend.engines[0].recovering = state == "recovering"
                    health = await http.get("/health")
                    if state in ("serving", "recovering"):  # (no engine behind this frontend: don't submit)
                        answers.append((health.status_code, health.json()["error"]["code"] if health.content else None))
                        continue
                    completion = await http.post("/v1/completions", json={"prompt": "Hi"})
                    answers.append((health.status_code, completion.status_code, completion.json()["error"]["code"]))
        finally:
            await api.stop()
            await frontend.shutdown()
        return answers

    serving, dead, draining, recovering = asyncio.run(scenario())
    assert serving == (200, None) and recovering == (503, "engine_restarting")
    assert dead == (503, 503, "engine_dead") and draining == (503, 503, "draining")


def test_every_server_process_froze_its_startup_heap(api):
    """ZLLM_GC_FREEZE (on by default): the frontend, the engine core and the worker each freeze
    what is alive after start-up, so the collector's oldest-generation walks no longer pause a
    served request for the whole heap (issue 40's p99 TTFT)."""
    import re
    import time

    deadline = time.monotonic() + 30  # the frontend freezes just after its ready line
    while time.monotonic() < deadline:
        frozen = dict(re.findall(r"(\w+(?: \w+)?): (\d+) start-up objects frozen", api.log()))
        if len(frozen) == 3:
            break
        time.sleep(0.2)
    assert sorted(frozen) == ["engine core", "frontend", "worker0"], api.log()[-3000:]
    assert all(int(count) > 10_000 for count in frozen.values()), frozen  # torch, transformers, ...


def test_pooling_routes_refuse_a_generative_model(api):
    # The reverse of tests/test_pooling_api.py's refusal: a text model serves no embeddings.
    response = post(api, "/v1/embeddings", {"model": MODEL, "input": "hello"}, AUTH)
    assert response.status_code == 400
    assert (
        response.json()["error"]["param"] == "task" and "needs a pooling model" in response.json()["error"]["message"]
    )
