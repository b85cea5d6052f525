"""What real OpenAI clients need, through the official `openai` package against a real
`vllm-launch` on the embedded SmolLM2: structured outputs (response_format, vLLM's
structured_outputs and guided_* fields), tool calling (required, named, auto with the hermes
parser), tolerant requests, best_of, echo, chat logprobs, include_usage, /tokenize, /detokenize.

The structured-output tests need the grammar engine (xgrammar in the engine core): the server's
part, tested here, is mapping the fields onto SamplingParams.structured_outputs and reading the
constrained text back (parsed objects, tool calls). Batches of 20 prompts run concurrently so
they share engine steps.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.helpers.server import start_server

pytestmark = pytest.mark.slow

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # see test_openai_api.py: one torch thread on a shared CPU
MODEL = "SmolLM2-135M-Instruct"
CITIES = [
    "Paris",
    "Berlin",
    "Rome",
    "Madrid",
    "Lisbon",
    "Vienna",
    "Prague",
    "Warsaw",
    "Dublin",
    "Oslo",
    "Athens",
    "Budapest",
    "Brussels",
    "Amsterdam",
    "Stockholm",
    "Helsinki",
    "Copenhagen",
    "Bern",
    "London",
    "Tokyo",
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def api(tmp_path_factory, smollm2_dir):
    handle = start_server(
        tmp_path_factory.mktemp("features"),
        smollm2_dir,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        env=ONE_THREAD,
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="unused", max_retries=0, timeout=300)


def concurrently(function, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(function, items))


def post(api, path: str, body: dict) -> httpx.Response:
    return httpx.post(api.http_url + path, json=body, timeout=120)


def ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather like in {city}?"}]


# ---- structured outputs (need the grammar engine) ------------------------------------------------------


class CityFacts(BaseModel):
    city: str
    country: str
    is_capital: bool
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


def test_parse_returns_the_pydantic_object_for_20_of_20(client):
    def parse(city):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"Give facts about {city} as JSON."}],
            response_format=CityFacts,
            max_tokens=80,
            temperature=0,
        )
        return completion.choices[0].message.parsed

    parsed = concurrently(parse, CITIES)
    assert all(isinstance(p, CityFacts) for p in parsed), parsed


def test_json_object_output_always_parses(client):
    def answer(city):
        completion = client.chat.completions.create(
            model=MODEL,
            response_format={"type": "json_object"},
            max_tokens=100,
            temperature=0,
            messages=[{"role": "user", "content": f"Give the name and country of {city} as a JSON object."}],
        )
        return completion.choices[0].message.content

    for text in concurrently(answer, CITIES[:8]):
        assert isinstance(json.loads(text), dict), text


def test_regex_and_choice_constrain_the_text_exactly(client):
    def complete(extra):
        return (
            client.completions.create(
                model=MODEL, prompt="My order code is", max_tokens=12, temperature=0, extra_body=extra
            )
            .choices[0]
            .text
        )

    regex, choice, older = concurrently(
        complete,
        [
            {"structured_outputs": {"regex": r"[A-Z]{3}-\d{4}"}},
            {"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
            {"guided_choice": ["yes", "no"]},
        ],
    )
    assert re.fullmatch(r"[A-Z]{3}-\d{4}", regex), regex
    assert choice in ("alpha", "beta", "gamma") and older in ("yes", "no")


# ---- tool calling ---------------------------------------------------------------------------------


def _calls_of_stream(chunks) -> tuple[list[tuple[str, str]], str]:
    """(name, arguments) per call from OpenAI's streamed deltas, and the last finish reason."""
    calls: dict[int, list] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish


def _tool_calls(client, city: str, tool_choice, stream: bool) -> tuple[list[tuple[str, str]], str]:
    # One call per answer (parallel_tool_calls: false makes the schema's maxItems 1): left free, a
    # 135M model goes on adding calls to the array until max_tokens cuts one in half.
    response = client.chat.completions.create(
        model=MODEL,
        messages=ask(city),
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
        stream=stream,
    )
    if stream:
        return _calls_of_stream(response)
    choice = response.choices[0]
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls], choice.finish_reason


def test_required_and_named_tool_arguments_validate_20_of_20_streaming_and_not(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    cases = [(city, choice, stream) for choice in ("required", named) for stream in (False, True) for city in CITIES]
    results = concurrently(lambda case: _tool_calls(client, *case), cases)
    for (city, choice, stream), (calls, finish) in zip(cases, results):
        assert len(calls) == 1, (city, choice, stream, calls)
        name, arguments = calls[0]
        assert choice == "required" or name == "get_time"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert finish == ("tool_calls" if choice == "required" else "stop")


def test_auto_reads_hermes_calls_out_of_the_text(client):
    # The regex makes the model write one hermes call; the parser turns it into tool_calls.
    call = (
        r'<tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}</tool_call>'
    )
    response = client.chat.completions.create(
        model=MODEL,
        messages=ask("Paris"),
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": {"regex": call}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    jsonschema.validate(json.loads(tool_call.function.arguments), SCHEMAS["get_weather"])


def test_tool_history_is_rendered_by_the_chat_template(api, client, smollm2_tokenizer):
    messages = [
        *ask("Paris"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "22 degrees, sunny"},
    ]
    rendered = post(api, "/tokenize", {"messages": messages, "tools": TOOLS}).json()
    template_messages = [
        *messages[:1],
        {
            **messages[1],
            "content": "",
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                }
            ],
        },
        messages[2],
    ]
    text = smollm2_tokenizer.apply_chat_template(
        template_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert rendered["tokens"] == smollm2_tokenizer.encode(text, add_special_tokens=False)
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0
    )
    assert answer.choices[0].message.content and answer.usage.prompt_tokens == rendered["count"]


# ---- tolerant requests and OpenAI's other fields -----------------------------------------------------


def test_unknown_fields_are_accepted_and_listed(api, client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=ask("Paris"),
        max_completion_tokens=2,
        user="u-1",
        metadata={"app": "test"},
        service_tier="auto",
        parallel_tool_calls=True,
        store=False,
        extra_body={"not_a_field": 1, "messages": [{"role": "user", "content": "Hi", "extra": True}]},
    )
    assert set(raw.headers["X-Ignored-Fields"].split(", ")) == {"store", "not_a_field", "messages[0].extra"}
    assert raw.parse().usage.completion_tokens == 2
    assert "ignoring the unknown request field 'not_a_field'" in api.log()


def test_best_of_returns_the_candidate_with_the_highest_cumulative_logprob(client):
    # Child i of a seeded request samples with seed + i, so best_of=4 draws the same 4 candidates as n=4.
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **args)
    best = client.completions.create(best_of=4, n=1, **args)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [ranked[0].text]
    assert best.choices[0].logprobs is None  # asked for none: the ranking's logprobs stay internal
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every candidate was generated


def test_echo_chat_logprobs_and_include_usage(client, smollm2_tokenizer):
    echoed = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    choice = echoed.choices[0]
    assert choice.text.startswith("The sky is") and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == len(smollm2_tokenizer.encode("The sky is")) + 3
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ask("Rome"),
            max_tokens=3,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    entries = [e for c in chunks[:-1] for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)


def test_tokenize_detokenize_version_and_models(api, client, smollm2_tokenizer):
    tokens = post(api, "/tokenize", {"prompt": "Hello world"}).json()
    assert tokens == {"count": 2, "max_model_len": 2048, "tokens": smollm2_tokenizer.encode("Hello world")}
    assert post(api, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert post(api, "/detokenize", {"tokens": [10**9]}).json()["error"]["param"] == "tokens"
    assert httpx.get(api.http_url + "/version").json()["version"]
    assert client.models.list().data[0].model_extra["max_model_len"] == 2048


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "suffix": "!"}, "suffix"),
        ("/tokenize", {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "best_of": 1, "n": 2}, "best_of"),
        ("/v1/completions", {"prompt": "Hi", "best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"prompt": "Hi", "best_of": "two"}, "best_of"),
        (
            "/v1/completions",
            {"prompt": "Hi", "guided_regex": "a+", "structured_outputs": {"choice": ["a"]}},
            "guided_regex",
        ),
        (
            "/v1/completions",
            {"prompt": "Hi", "structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
        ),
        ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "json_schema"}}, "response_format"),
        ("/v1/completions", {"prompt": "Hi", "response_format": {"type": "xml"}}, "response_format"),
        ("/v1/chat/completions", {"messages": ask("Rome"), "tool_choice": "required"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {
                "messages": ask("Rome"),
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": ask("Rome"),
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": ask("Rome"), "tools": [{"type": "function"}]}, "tools"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_fields_are_400_naming_them(api, path, body, param):
    response = post(api, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
                }
            },
            "response_format",
        ),
    ],
)
def test_a_constraint_the_grammar_engine_cannot_compile_is_400_naming_it(api, body, param):
    response = post(api, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
