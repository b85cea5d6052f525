"""OpenAI's Responses API (`/v1/responses`): the request, the response object, its output items and
the typed streaming events, as msgspec Structs (field names and shapes are OpenAI's).

The request's `input` items are kept as plain JSON objects: OpenAI lets a message item omit its
`type`, which a tagged union cannot express; responses.py reads each one and names the bad one
in a 400.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

import msgspec

from zllm.frontend.openai.protocol import JsonSchemaFormat


class _Body(msgspec.Struct, kw_only=True):
    pass


def item_id(prefix: str) -> str:
    """An id as OpenAI writes them: resp_..., msg_..., fc_..., rs_..."""
    return f"{prefix}_{secrets.token_hex(16)}"


# ---- the request ----------------------------------------------------------------------------------


class FunctionTool(_Body, kw_only=True):
    """A function tool, flat as the Responses API writes it (chat nests it under `function`)."""

    type: str = "function"  # anything else (web_search, file_search, ...) is refused
    name: str = ""
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Body, kw_only=True):
    type: Literal["function"] = "function"
    name: str


class TextFormat(JsonSchemaFormat, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"


class TextOptions(_Body, kw_only=True):
    format: TextFormat | None = None


class ReasoningOptions(_Body, kw_only=True):
    effort: str | None = None  # accepted; the model decides how long it thinks
    summary: str | None = None


class ResponsesRequest(_Body, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message before the input (not carried to the next turn)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True  # kept only when the server runs with --enable-responses-store
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    # vLLM's extensions, as in chat completions
    seed: int | None = None
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- the response ---------------------------------------------------------------------------------


class OutputText(_Body, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(_Body, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(_Body, kw_only=True, tag_field="type", tag="message"):
    id: str
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = []


class FunctionCallItem(_Body, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


class ReasoningItem(_Body, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: str = "completed"


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(_Body, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(_Body, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(_Body, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(_Body, kw_only=True):
    reason: str


class ResponseObject(_Body, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str  # in_progress, completed, incomplete
    model: str
    output: list[OutputItem] = []
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = []
    tool_choice: str | NamedFunctionChoice = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = False
    metadata: dict[str, str] | None = None
    text: TextOptions = msgspec.field(default_factory=lambda: TextOptions(format=TextFormat()))
    truncation: str = "disabled"


# ---- streaming events (`event: <type>` + `data: <json>`) ------------------------------------------


class _Event(_Body, kw_only=True):
    type: str
    sequence_number: int = 0  # numbered as they are sent


class LifecycleEvent(_Event, kw_only=True):
    """response.created, response.in_progress, response.completed, response.incomplete."""

    response: ResponseObject


class OutputItemEvent(_Event, kw_only=True):
    """response.output_item.added / .done."""

    output_index: int
    item: OutputItem


class ContentPartEvent(_Event, kw_only=True):
    """response.content_part.added / .done."""

    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(_Event, kw_only=True):
    """response.output_text.delta and response.reasoning_text.delta."""

    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(_Event, kw_only=True):
    """response.output_text.done and response.reasoning_text.done."""

    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = []


class ArgumentsDeltaEvent(_Event, kw_only=True):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event, kw_only=True):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event, kw_only=True):
    message: str
    code: str | None = None
    param: str | None = None


ResponseEvent = (
    LifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)
