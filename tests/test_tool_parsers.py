"""Tool-call parsers (hermes, llama3_json, mistral, and tool_choice's required/named forms): whole
outputs, and the same outputs streamed in pieces, whose deltas must add up to the same calls."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from zllm.frontend.openai.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolCallStream,
    tool_parser,
)

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2], "note": 'a "quoted" }] brace'}
TIME = {"zone": "UTC"}

CASES = [  # parser, output text, expected content, expected [(name, arguments)]
    (
        HermesParser(),
        f'Let me check.\n<tool_call>\n{{"name": "weather", "arguments": {json.dumps(WEATHER)}}}\n'
        f'</tool_call>\n<tool_call>\n{{"arguments": {json.dumps(TIME)}, "name": "time"}}\n</tool_call>',
        "Let me check.",
        [("weather", WEATHER), ("time", TIME)],
    ),
    (HermesParser(), "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", []),
    (
        Llama3JsonParser(),
        f'{{"name": "weather", "parameters": {json.dumps(WEATHER)}}}; '
        f'{{"name": "time", "parameters": {json.dumps(TIME)}}}',
        None,
        [("weather", WEATHER), ("time", TIME)],
    ),
    (Llama3JsonParser(), f'<|python_tag|>{{"name": "time", "parameters": {json.dumps(TIME)}}}', None, [("time", TIME)]),
    (Llama3JsonParser(), "The answer is {not a call}.", "The answer is {not a call}.", []),
    (
        MistralParser(),
        f'[TOOL_CALLS] [{{"name": "weather", "arguments": {json.dumps(WEATHER)}}}, '
        f'{{"name": "time", "arguments": {json.dumps(TIME)}}}]',
        None,
        [("weather", WEATHER), ("time", TIME)],
    ),
    (MistralParser(), "Just text [TOOL", "Just text [TOOL", []),
    (RequiredParser(), f'[{{"name": "weather", "parameters": {json.dumps(WEATHER)}}}]', None, [("weather", WEATHER)]),
    (NamedParser("weather"), json.dumps(WEATHER, indent=1), None, [("weather", WEATHER)]),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output(parser, text, content, calls):
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("piece", [1, 2, 3, 7])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_output_adds_up_to_the_whole(parser, text, content, calls, piece):
    stream = ToolCallStream(parser)
    streamed_content, names, ids, arguments = "", [], [], []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for i, delta in enumerate(pieces):
        got, deltas = stream.feed(delta, final=i == len(pieces) - 1)
        streamed_content += got
        for d in deltas:
            if d.id is not None:  # the first piece of a call: id and name, in index order
                assert d.index == len(names)
                names.append(d.name)
                ids.append(d.id)
                arguments.append("")
            arguments[d.index] += d.arguments
    assert [(n, json.loads(a)) for n, a in zip(names, arguments)] == calls
    expected_content = text if not calls else content or ""
    assert streamed_content.strip() == expected_content.strip()


def test_streamed_arguments_arrive_before_the_call_ends():
    stream = ToolCallStream(HermesParser())
    content, deltas = stream.feed('Hi <tool_call>{"name": "weather", "arguments": {"city": "Pa')
    assert content == "Hi " and deltas[0].name == "weather" and deltas[0].arguments == '{"city": "Pa'
    content, deltas = stream.feed('ris"}}</tool_call>', final=True)
    assert content == "" and [(d.index, d.id, d.arguments) for d in deltas] == [(0, None, 'ris"}')]


def test_a_partial_marker_is_held_back_until_it_is_known():
    stream = ToolCallStream(HermesParser())
    assert stream.feed("Sure <tool_")[0] == "Sure "
    assert stream.feed("tip>", final=True)[0] == "<tool_tip>"


def test_invalid_arguments_are_not_a_call():
    content, calls = HermesParser().extract('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>')
    assert calls == [] and content.startswith("<tool_call>")


def test_mistral_ids_are_nine_alphanumerics_and_unknown_parsers_are_refused():
    _, calls = MistralParser().extract('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    with pytest.raises(ValueError, match="^tool_call_parser"):
        tool_parser("pythonic")


def test_the_cli_and_the_docs_list_the_parsers_there_are():
    from zllm.config import TOOL_CALL_PARSERS
    from zllm.launch.cli import build_parser

    assert tuple(PARSERS) == TOOL_CALL_PARSERS  # the config's names, each with its parser class
    (action,) = [a for a in build_parser()._actions if a.dest == "tool_call_parser"]
    assert list(action.choices) == list(PARSERS)
    root = Path(__file__).resolve().parent.parent
    readme = re.search(r"--tool-call-parser \{([^}]*)\}", (root / "README.md").read_text())
    assert readme and readme.group(1).split(",") == list(PARSERS)
    api_doc = (root / "docs/api.md").read_text()
    paragraph = api_doc[api_doc.index("Parsers (`--tool-call-parser`") :].split("\n\n")[0]
    assert re.findall(r"`(\w+)`\s*\n?\(", paragraph) == list(PARSERS)
