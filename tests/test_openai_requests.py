"""The OpenAI request fields that need no engine: tolerant decoding, the mapping of
response_format / structured_outputs / guided_* / tool_choice onto StructuredOutputsParams, and
when tool calls are read (vLLM's rules)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import msgspec
import pytest

from zllm.frontend.openai.constraints import structured_outputs_of, tool_choice_schema
from zllm.frontend.openai.protocol import (
    BadRequestError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
    openapi_document,
)
from zllm.frontend.openai.serving import tool_mode
from zllm.frontend.parallel_sampling import best_of_indices
from zllm.sampling_params import StructuredOutputsParams

MESSAGES = [{"role": "user", "content": "Hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def chat(**fields) -> ChatCompletionRequest:
    return decode_request(json.dumps({"messages": MESSAGES, **fields}).encode(), ChatCompletionRequest)[0]


def completion(**fields) -> CompletionRequest:
    return decode_request(json.dumps({"prompt": "Hi", **fields}).encode(), CompletionRequest)[0]


def test_unknown_fields_are_ignored_and_named_by_path():
    body = {
        "prompt": "Hi",
        "best_of": 1,
        "zz": 1,
        "stream_options": {"include_usage": True, "x": 2},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "y": 3}},
    }
    request, ignored = decode_request(json.dumps(body).encode(), CompletionRequest)
    assert request.best_of == 1 and request.stream_options.include_usage
    assert ignored == ["zz", "stream_options.x", "response_format.json_schema.y"]
    _, ignored = decode_request(
        json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}], "w": 1}]}
        ).encode(),
        ChatCompletionRequest,
    )
    assert ignored == ["messages[0].w", "messages[0].content[0].cache_control"]


def test_a_known_field_with_a_wrong_type_is_still_refused():
    with pytest.raises(BadRequestError) as error:
        decode_request(b'{"prompt": "Hi", "max_tokens": "many", "zz": 1}', CompletionRequest)
    assert error.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
                }
            },
            StructuredOutputsParams(json={"type": "object"}),
        ),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, StructuredOutputsParams(grammar='root ::= "x"')),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, StructuredOutputsParams(json='{"type": "string"}')),
        ({"guided_json": {"type": "integer"}}, StructuredOutputsParams(json={"type": "integer"})),
        ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "y"'}, StructuredOutputsParams(grammar='root ::= "y"')),
    ],
)
def test_constraint_fields_map_to_structured_outputs(fields, expected):
    assert structured_outputs_of(completion(**fields)) == expected
    assert structured_outputs_of(chat(**fields)) == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"guided_regex": ""}, "guided_regex"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(fields, param):
    with pytest.raises(BadRequestError) as error:
        structured_outputs_of(completion(**fields))
    assert error.value.param == param and str(error.value).startswith(param)


def test_required_schema_accepts_exactly_calls_of_the_given_tools():
    request = chat(tools=TOOLS, tool_choice="required")
    schema = tool_choice_schema(request.tools, request.tool_choice, parallel=True)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}], schema)
    for wrong in (
        [],
        [{"name": "add", "parameters": {"a": 1}}],
        [{"name": "sub", "parameters": {}}],
        {"name": "now", "parameters": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = tool_choice_schema(request.tools, request.tool_choice, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, single)


def test_named_choice_forces_that_functions_parameters():
    request = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert tool_choice_schema(request.tools, request.tool_choice, True) == TOOLS[0]["function"]["parameters"]
    assert structured_outputs_of(
        request, tool_choice_schema(request.tools, request.tool_choice, True)
    ) == StructuredOutputsParams(json=TOOLS[0]["function"]["parameters"])


def _server(auto: bool, parser: str | None):
    return SimpleNamespace(config=SimpleNamespace(enable_auto_tool_choice=auto, tool_call_parser=parser))


def test_tool_mode_follows_vllms_rules():
    assert tool_mode(_server(False, None), chat()) is None
    assert tool_mode(_server(False, None), chat(tools=TOOLS, tool_choice="none")) is None
    assert tool_mode(_server(False, None), chat(tools=TOOLS, tool_choice="required")).choice == "required"
    assert tool_mode(_server(True, "mistral"), chat(tools=TOOLS)).parser.name == "mistral"  # auto by default
    for server, request in [
        (_server(False, None), chat(tools=TOOLS)),  # auto without the flags
        (_server(True, "hermes"), chat(tool_choice="auto")),  # no tools
        (_server(True, "hermes"), chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})),
    ]:
        with pytest.raises(BadRequestError) as error:
            tool_mode(server, request)
            tool_choice_schema(request.tools, request.tool_choice, True)
        assert error.value.param == "tool_choice"


def test_best_of_keeps_the_highest_cumulative_logprobs():
    assert best_of_indices([-3.0, -1.0, None, -2.0, -1.0], 3) == [1, 4, 3]


def test_openapi_documents_the_new_fields_and_routes():
    document = openapi_document("test")
    schemas = document["components"]["schemas"]
    chat_fields = schemas["ChatCompletionRequest"]["properties"]
    for name in (
        "tools",
        "tool_choice",
        "response_format",
        "structured_outputs",
        "guided_json",
        "best_of",
        "parallel_tool_calls",
        "metadata",
        "service_tier",
        "max_completion_tokens",
    ):
        assert name in chat_fields
    assert "additionalProperties" not in schemas["ChatCompletionRequest"]  # unknown fields are accepted
    assert {"/tokenize", "/detokenize", "/version", "/v1/models"} <= set(document["paths"])
    assert "max_model_len" in schemas["ModelCard"]["properties"]


def test_the_ignored_fields_header_is_printable_ascii_and_bounded():
    from zllm.frontend.openai.api_server import ignored_fields_header

    assert ignored_fields_header(["a", "messages[0].b"]) == "a, messages[0].b"
    assert ignored_fields_header(["\x1f", "é\n"]) == "\\u001f, \\u00e9\\n"
    long = ignored_fields_header([f"field_{i}" for i in range(1000)])
    assert len(long) < 1100 and long.endswith("more)") and long.isascii()


# ---- tool calls in chat responses, from engine outputs (no model: the text is given) -------------------


class _FakeEngineCall:
    """The part of EngineCall that ChatCall reads, replaying given text deltas for one choice."""

    def __init__(self, deltas: list[str], finish_reason: str = "stop") -> None:
        from zllm.frontend.openai.serving import _Choice
        from zllm.ipc.messages import ServerOutput

        last = len(deltas) - 1
        self.messages = [
            ServerOutput("0", text=d, finish_reason=finish_reason if i == last else None, finished=i == last)
            for i, d in enumerate(deltas)
        ]
        self.choices = [_Choice(text=list(deltas), finish_reason=finish_reason)]

    async def wait(self) -> None:
        pass

    async def outputs(self):
        for message in self.messages:
            yield 0, message

    def usage(self):
        from zllm.frontend.openai.protocol import UsageInfo

        return UsageInfo(prompt_tokens=1, completion_tokens=len(self.messages), total_tokens=1 + len(self.messages))


def _chat_call(tool_choice, parser):
    from zllm.frontend.openai.serving import ChatCall, Prompt, ToolMode
    from zllm.sampling_params import SamplingParams

    request = chat(tools=TOOLS, tool_choice=tool_choice, stream=True)
    return ChatCall(
        request,
        "m",
        Prompt("x", [1]),
        SamplingParams(),
        ToolMode(tool_choice if isinstance(tool_choice, str) else "named", parser, single=False),
    )


HERMES_OUTPUT = ["Sure.", " <tool_", 'call>{"name": "add", "argu', 'ments": {"a": 1, ', '"b": 2}}</tool_call>']


def test_auto_chat_response_and_stream_carry_openai_tool_calls():
    import asyncio

    from zllm.frontend.openai.tool_parsers import HermesParser

    response = asyncio.run(_chat_call("auto", HermesParser()).response(None, _FakeEngineCall(HERMES_OUTPUT)))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("add", {"a": 1, "b": 2})
    ]

    async def stream():
        return [c async for c in _chat_call("auto", HermesParser()).chunks(None, _FakeEngineCall(HERMES_OUTPUT))]

    chunks = [json.loads(msgspec.json.encode(c)) for c in asyncio.run(stream())]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "
    pieces = [t for d in deltas for t in d.get("tool_calls", [])]
    assert pieces[0]["id"].startswith("chatcmpl-tool-") and pieces[0]["type"] == "function"
    assert pieces[0]["function"]["name"] == "add" and all("id" not in p for p in pieces[1:])
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {"a": 1, "b": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_named_choice_ends_with_stop_and_plain_text_stays_content():
    import asyncio

    from zllm.frontend.openai.tool_parsers import HermesParser, NamedParser

    named = {"type": "function", "function": {"name": "add"}}
    outputs = _FakeEngineCall(['{"a": 1,', ' "b": 2}'])
    response = asyncio.run(_chat_call(named, NamedParser("add")).response(None, outputs))
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments == '{"a": 1, "b": 2}'
    plain = asyncio.run(_chat_call("auto", HermesParser()).response(None, _FakeEngineCall(["No", " tools."])))
    assert plain.choices[0].message.content == "No tools." and plain.choices[0].message.tool_calls == []
    assert plain.choices[0].finish_reason == "stop"


def test_tool_flags_are_checked_with_the_config():
    import argparse

    from zllm.config import EngineConfig
    from zllm.launch.args import add_http_args, http_kwargs

    parser = argparse.ArgumentParser()
    add_http_args(parser)
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert http_kwargs(args)["tool_call_parser"] == "llama3_json" and http_kwargs(args)["enable_auto_tool_choice"]
    with pytest.raises(ValueError, match="^enable_auto_tool_choice"):
        EngineConfig(model="m", max_model_len=64, enable_auto_tool_choice=True).validate()
    with pytest.raises(ValueError, match="^tool_call_parser"):  # offline (LLM) and served alike
        EngineConfig(model="m", max_model_len=64, tool_call_parser="pythonic").validate()
