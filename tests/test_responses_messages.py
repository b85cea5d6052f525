"""The newer client APIs against a real `vllm-launch` on the embedded SmolLM2, through the official
clients: OpenAI's Responses API (`openai`'s `responses.create`) and Anthropic's Messages API
(`anthropic`'s `messages.create`). Both translate to a chat completion, so each answer is checked
against the chat completion of the same conversation (greedy: the same tokens), streamed and not,
with a function tool (grammar-forced, so a 135M model calls it reliably), and bad input answered
with a 400 in the API's own error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.helpers.server import ONE_THREAD, start_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": WEATHER_SCHEMA,
}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def api(tmp_path_factory, smollm2_dir):
    handle = start_server(tmp_path_factory.mktemp("newer"), smollm2_dir, "--enable-responses-store", env=ONE_THREAD)
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, messages: list[dict], max_tokens: int = 16):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


# ---- /v1/responses ----------------------------------------------------------------------------


def test_responses_plain_equals_the_chat_completion(client):
    response = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input=QUESTION, max_output_tokens=16, temperature=0
    )
    chat = _chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"


def test_responses_stream_sends_typed_events_that_add_up(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    events = list(
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_responses_function_tool_call_and_its_output(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.responses.create(
        model=MODEL, input=ask, tools=[RESPONSES_TOOL], tool_choice="required", max_output_tokens=40, temperature=0
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", called.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)

    streamed = list(
        client.responses.create(
            model=MODEL,
            input=ask,
            tools=[RESPONSES_TOOL],
            tool_choice="required",
            max_output_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert deltas == done.arguments == calls[0].arguments and done.name == "get_weather"

    # The call and its result go back as items; the model answers in text.
    follow = ask + [
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C and sunny"},
    ]
    answer = client.responses.create(
        model=MODEL, input=follow, tools=[RESPONSES_TOOL], tool_choice="none", max_output_tokens=16, temperature=0
    )
    assert answer.output_text and answer.usage.input_tokens > called.usage.input_tokens


def test_responses_chained_by_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=12, temperature=0)
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=12, temperature=0
    )
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=1, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    # The second prompt is exactly the whole first turn (its input and its answer), then the new input.
    chat = _chat(
        client,
        [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_tokens=12,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": [{"type": "image", "url": "x"}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": -1}, 400, "max_tokens"),
        ({"input": 3}, 400, "input"),
    ],
)
def test_responses_bad_input_is_an_openai_error(api, body, status, param):
    response = httpx.post(f"{api.http_url}/v1/responses", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


# ---- /v1/messages -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def claude(api) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api.http_url, api_key="unused", max_retries=0, timeout=120)


# This anthropic client has no temperature argument (the server takes the field): sample greedily.
GREEDY = {"temperature": 0}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER_SCHEMA}


def test_messages_plain_equals_the_chat_completion(client, claude):
    message = claude.messages.create(
        model=MODEL,
        system="Answer briefly.",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        extra_body=GREEDY,
    )
    chat = _chat(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]


def test_messages_stop_sequences_end_with_stop_sequence(claude):
    whole = claude.messages.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, extra_body=GREEDY
    )
    word = whole.content[0].text.split()[2]  # a word the answer is known to contain
    stopped = claude.messages.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24,
        extra_body=GREEDY,
        stop_sequences=[word],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text and whole.content[0].text.startswith(stopped.content[0].text)


def test_messages_stream_sends_anthropic_events_that_add_up(claude):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=24, extra_body=GREEDY)
    whole = claude.messages.create(**ask)
    events = list(claude.messages.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert (
        events[-2].delta.stop_reason == whole.stop_reason
        and events[-2].usage.output_tokens == whole.usage.output_tokens
    )
    with claude.messages.stream(**ask) as stream:  # the client's own accumulator agrees
        assert stream.get_final_message().content[0].text == whole.content[0].text


def test_messages_tool_use_and_tool_result(claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = claude.messages.create(
        model=MODEL, messages=ask, tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"}, max_tokens=40, extra_body=GREEDY
    )
    uses = [b for b in called.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and called.stop_reason == "tool_use", called
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)

    events = list(
        claude.messages.create(
            model=MODEL,
            messages=ask,
            tools=[ANTHROPIC_TOOL],
            tool_choice={"type": "tool", "name": "get_weather"},
            max_tokens=40,
            extra_body=GREEDY,
            stream=True,
        )
    )
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    arguments = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)

    follow = ask + [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "22 C and sunny"}]},
    ]
    answer = claude.messages.create(
        model=MODEL,
        messages=follow,
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "none"},
        max_tokens=16,
        extra_body=GREEDY,
    )
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.usage.input_tokens > called.usage.input_tokens


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400),  # no max_tokens
        ({"max_tokens": 8, "messages": []}, 400),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
        ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, 400),
        ({"max_tokens": -1, "messages": [{"role": "user", "content": "hi"}]}, 400),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "tool"}}, 400),
        ({"max_tokens": 8, "model": "claude-9", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ],
)
def test_messages_bad_input_is_an_anthropic_error(api, body, status):
    body = {"model": MODEL, **body}
    response = httpx.post(f"{api.http_url}/v1/messages", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert error["error"]["message"]


def test_anthropic_client_raises_its_own_error_type(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, messages=[], max_tokens=8)
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_the_response_store_is_bounded_and_forgets_the_oldest():
    from zllm.frontend.openai.responses import ResponseStore, StoredResponse
    from zllm.frontend.openai.responses_protocol import ResponseObject

    store = ResponseStore(capacity=3)
    for i in range(5):
        store.put(StoredResponse(ResponseObject(id=f"resp_{i}", created_at=0, status="completed", model="m"), []))
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
