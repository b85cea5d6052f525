"""Tool calls out of generated text, whole or as it streams, in the formats vLLM's parsers read.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (any number; text before is content)
    llama3_json  [<|python_tag|>]{"name": ..., "parameters": {...}}; {...}     (the whole output is calls)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]         (text before is content)
    required     [{"name": ..., "parameters": {...}}, ...]   (tool_choice "required": grammar-enforced JSON)
    named        {...}                                        (tool_choice naming one function: its arguments)

Every parser maps the text generated so far to `Parsed`: the content that is safe to show (it
only grows as text arrives; a possible start of a tool-call marker is held back) and the calls
seen so far, each with its name once the name's JSON string is complete and the raw JSON text of
its arguments so far. Streaming (`ToolCallStream`) sends the difference from what was sent, so
the arguments' deltas concatenate to exactly the text the model wrote, and the non-streamed
response carries the same text. Partial JSON is read by a small scanner over spans (we need
where a value starts and whether it has ended, not its value), rescanning the whole text on each
delta: outputs are short and it keeps the state trivially right.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class PartialCall:
    name: str | None = None  # known once its JSON string is complete
    arguments: str = ""  # raw JSON text of the arguments so far
    complete: bool = False  # the arguments' value has ended


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


# ---- a scanner for partial JSON -------------------------------------------------------------------


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index just past the JSON string starting at text[i] == '"'; None if it has not ended."""
    i += 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value starting at text[i]; None if it has not ended yet (a number
    or literal running to the end of the text may still grow)."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            if text[i] == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if text[i] in "{[":
                depth += 1
            elif text[i] in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None


def scan_call(text: str, i: int) -> tuple[PartialCall | None, int | None]:
    """The call object starting at or after text[i] (None if no '{' there yet), and the index just
    past it (None while it is incomplete)."""
    i = _skip_ws(text, i)
    if i >= len(text) or text[i] != "{":
        return None, None
    call = PartialCall()
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return call, None
        if text[i] == "}":
            return call, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return call, None  # not JSON: stop reading (the final check rejects it)
        key_end = _string_end(text, i)
        if key_end is None:
            return call, None
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return call, None
        start = _skip_ws(text, i + 1)
        if start >= len(text):
            return call, None
        end = _value_end(text, start)
        if key == "name" and end is not None and text[start] == '"':
            call.name = json.loads(text[start:end])
        elif key in _ARGUMENT_KEYS:
            call.arguments = text[start : end if end is not None else len(text)]
            call.complete = end is not None
        if end is None:
            return call, None
        i = end


def scan_calls(text: str, i: int, separator: str = ",") -> list[PartialCall]:
    """Call objects one after another from text[i], separated by `separator` (and whitespace)."""
    calls = []
    while True:
        call, end = scan_call(text, i)
        if call is None:
            return calls
        calls.append(call)
        if end is None:
            return calls
        i = _skip_ws(text, end)
        if not text.startswith(separator, i):
            return calls
        i += len(separator)


def held_back(text: str, marker: str) -> str:
    """Text without a trailing partial `marker` (it may be the start of one)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


# ---- the formats --------------------------------------------------------------------------------


class ToolParser:
    """One format; `parse` reads the text generated so far (final: the generation has ended)."""

    name = ""
    needs_special_tokens = False  # its marker is a special token, kept only with skip_special_tokens=False

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def new_id(self) -> str:
        return f"chatcmpl-tool-{secrets.token_hex(16)}"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output's content and its valid calls (a name and arguments that parse as a
        JSON object). Text with no valid call is all content, as vLLM answers."""
        parsed = self.parse(text, final=True)
        calls = [ToolCall(self.new_id(), c.name, c.arguments) for c in parsed.calls if _valid(c)]
        if not calls:
            return text, []
        return parsed.content or None, calls


def _valid(call: PartialCall) -> bool:
    if call.name is None or not call.complete:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(self.START)
        if first < 0:
            return Parsed(text if final else held_back(text, self.START))
        calls, i = [], first
        while i >= 0:
            call, _ = scan_call(text, i + len(self.START))
            if call is not None:
                calls.append(call)
            i = text.find(self.START, i + len(self.START))
        return Parsed(text[:first].rstrip(_WHITESPACE) if final else text[:first], calls)


class Llama3JsonParser(ToolParser):
    """Llama 3.x's JSON tool calls: the output is one or more call objects separated by ';',
    optionally after <|python_tag|>; anything else is plain content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        i = _skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = _skip_ws(text, i + len(self.TAG))
            if i == len(text) and not final:
                return Parsed()  # the tag says calls follow
        elif not final and self.TAG.startswith(text[i:]):
            return Parsed()  # undecided: maybe the tag is coming
        if i < len(text) and text[i] == "{":
            return Parsed("", scan_calls(text, i, ";"))
        return Parsed(text)


class MistralParser(ToolParser):
    """Mistral's v0.3 format: [TOOL_CALLS] then a JSON array of calls; ids are 9 letters or digits
    because Mistral's chat templates refuse any other."""

    name = "mistral"
    needs_special_tokens = True
    MARKER = "[TOOL_CALLS]"
    _ID_CHARS = string.ascii_letters + string.digits

    def new_id(self) -> str:
        return "".join(secrets.choice(self._ID_CHARS) for _ in range(9))

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.MARKER)
        if at < 0:
            return Parsed(text if final else held_back(text, self.MARKER))
        i = _skip_ws(text, at + len(self.MARKER))
        calls = []
        if i < len(text) and text[i] == "[":
            calls = scan_calls(text, i + 1)
        elif i < len(text):
            calls = scan_calls(text, i)  # a lone object, as some checkpoints write
        return Parsed(text[:at].rstrip(_WHITESPACE) if final else text[:at], calls)


class RequiredParser(ToolParser):
    """tool_choice "required": the grammar makes the output a JSON array of {name, parameters}."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = _skip_ws(text, 0)
        if i < len(text) and text[i] == "[":
            return Parsed("", scan_calls(text, i + 1))
        return Parsed("" if not final else text)


class NamedParser(ToolParser):
    """tool_choice naming one function: the grammar makes the whole output its arguments."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> Parsed:
        start = _skip_ws(text, 0)
        complete = final or (start < len(text) and _value_end(text, start) is not None)
        return Parsed(
            "", [PartialCall(self.function_name, text[start:].rstrip(_WHITESPACE) if final else text[start:], complete)]
        )


# The --tool-call-parser choices (vLLM's names) and their parsers: the one list that the CLI's
# choices, the check of a config and the docs (tests/test_tool_parsers.py holds them to it) follow.
PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}


def check_tool_call_parser(name: str | None) -> None:
    """Refuse a --tool-call-parser name that no parser has (None: no parser, tool_choice "auto" off)."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"tool_call_parser: must be one of {sorted(PARSERS)}, got {name!r}")


def tool_parser(name: str) -> ToolParser:
    """The parser `--tool-call-parser name` selects."""
    check_tool_call_parser(name)
    return PARSERS[name]()


# ---- streaming ------------------------------------------------------------------------------------


@dataclass(slots=True)
class CallDelta:
    """One streamed piece of call `index`: its id and name first (once), then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCallStream:
    """Feeds generated text deltas through a parser; returns what to send for each."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.sent_arguments: list[int] = []  # per call whose header (id, name) has been sent

    @property
    def called(self) -> bool:
        return bool(self.sent_arguments)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final=False)
        calls = self._call_deltas(parsed.calls)
        if final and not self.called:  # no call after all: everything is content (as `extract` says)
            parsed = Parsed(self.text)
        # Content is always a prefix of the text, so what is new is what lies past what was sent.
        content = parsed.content[self.sent_content :]
        self.sent_content += len(content)
        return content, calls

    def _call_deltas(self, calls: list[PartialCall]) -> list[CallDelta]:
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.sent_arguments):
                if call.name is None:
                    break  # a call's header goes out once its name is known, in order
                deltas.append(CallDelta(index, self.parser.new_id(), call.name))
                self.sent_arguments.append(0)
            new = call.arguments[self.sent_arguments[index] :]
            if new:
                if deltas and deltas[-1].index == index:
                    deltas[-1].arguments = new
                else:
                    deltas.append(CallDelta(index, arguments=new))
                self.sent_arguments[index] = len(call.arguments)
        return deltas
