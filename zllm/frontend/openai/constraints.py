"""From the OpenAI request fields that constrain the output to `StructuredOutputsParams`.

    response_format {"type": "json_object"}                   -> json_object=True
    response_format {"type": "json_schema", "json_schema": {"schema": S}}  -> json=S
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  (vLLM)
    guided_json / guided_regex / guided_choice / guided_grammar                          (vLLM, older)
    tool_choice "required"                 -> json = an array of {name, parameters} calls (as vLLM)
    tool_choice {"function": {"name": F}}  -> json = F's parameters schema

A request may set one of these at most (400 naming the second). The grammar engine (the engine
core, with xgrammar) enforces the result; a schema it cannot compile is its 400.
"""

from __future__ import annotations

import json
from typing import Any

from zllm.frontend.openai.protocol import (
    BadRequestError,
    ChatCompletionRequest,
    ChatTool,
    CompletionRequest,
    NamedToolChoice,
)
from zllm.grammars import grammar_of
from zllm.sampling_params import StructuredOutputsParams

_NO_ARGUMENTS = {"type": "object", "properties": {}}


def structured_outputs_of(
    request: CompletionRequest | ChatCompletionRequest, tool_constraint: dict | None = None
) -> StructuredOutputsParams | None:
    """The one output constraint the request asks for (None: free text)."""
    found = _constraints(request)
    if tool_constraint is not None:
        found.append(("tool_choice", {"json": tool_constraint}))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise BadRequestError(f"{found[1][0]}: only one output constraint per request, got {names}", found[1][0])
    if not found:
        return None
    name, fields = found[0]
    try:
        params = StructuredOutputsParams(**fields)
    except ValueError as error:
        raise BadRequestError(f"{name}: {str(error).removeprefix('structured_outputs: ')}", name) from None
    # A tool's parameters schema that cannot work is the tools' fault, not tool_choice's.
    _validate_structured_outputs(params, "tools" if name == "tool_choice" else name)
    return params


def _constraints(request: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, dict[str, Any]]]:
    found = []
    response_format = _response_format(request)
    if response_format is not None:
        found.append(("response_format", response_format))
    if request.structured_outputs is not None:
        so = request.structured_outputs
        fields = {
            k: v
            for k, v in (("json", so.json), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar))
            if v is not None
        }
        if so.json_object:
            fields["json_object"] = True
        found.append(("structured_outputs", fields))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", {name: value}))
    return found


def _response_format(request: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.json_schema is None:
        raise BadRequestError("response_format: type json_schema needs a json_schema object", "response_format")
    schema = response_format.json_schema.schema
    return {"json": schema} if schema is not None else {"json_object": True}


def _validate_structured_outputs(params: StructuredOutputsParams, field_name: str) -> None:
    """Refuse a constraint that cannot work, with a 400 naming the request field it came from.

    xgrammar builds the schema, regex or grammar here (`grammar_of`); the InputProcessor checks
    again, but its error can only name `structured_outputs`. The frontend's own checks come first."""
    if params.json is not None:
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise BadRequestError(f"{field_name}: the JSON schema is not valid JSON: {error}", field_name) from None
        if not isinstance(schema, dict):
            raise BadRequestError(f"{field_name}: the JSON schema must be an object", field_name)
    for name in ("regex", "grammar"):
        if getattr(params, name) == "":
            raise BadRequestError(f"{field_name}: {name} must not be empty", field_name)
    try:
        grammar_of(params)
    except ValueError as error:
        reason = str(error).removeprefix("structured_outputs: ")
        raise BadRequestError(f"{field_name}: {reason}", field_name) from None


# ---- tool_choice -----------------------------------------------------------------------------------


def tool_choice_schema(tools: list[ChatTool], choice: str | NamedToolChoice, parallel: bool) -> dict | None:
    """The JSON schema that `required` or a named choice forces the output into (None for auto and
    none). required: an array of calls, each {name: one tool's name, parameters: that tool's
    schema}, as vLLM builds it; named: that function's parameters."""
    if isinstance(choice, NamedToolChoice):
        return named_tool(tools, choice.function.name).function.parameters or _NO_ARGUMENTS
    if choice != "required":
        return None
    calls = [
        {
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or _NO_ARGUMENTS,
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_tool(tools: list[ChatTool], name: str) -> ChatTool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise BadRequestError(f"tool_choice: no tool named {name!r} in tools", "tool_choice")
