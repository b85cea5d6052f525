"""Anthropic's Messages API (`/v1/messages`): the request, the message it answers with, and the
streaming events, as msgspec Structs (field names and shapes are Anthropic's).

Content blocks are tagged by `type`; a block type this server does not take (image, document,
...) fails decoding with a 400 that names it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class _Body(msgspec.Struct, kw_only=True):
    pass


# ---- the request ----------------------------------------------------------------------------------


class TextBlock(_Body, kw_only=True, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(_Body, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Body, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


InputBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class InputMessage(_Body, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[InputBlock]


class Tool(_Body, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool = False


class MessagesRequest(_Body, kw_only=True):
    model: str
    max_tokens: int
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    # vLLM's extensions, as in chat completions
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---- the answer -----------------------------------------------------------------------------------

OutputBlock = TextBlock | ToolUseBlock | ThinkingBlock


class Usage(_Body, kw_only=True):
    input_tokens: int
    output_tokens: int


class Message(_Body, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock] = []
    stop_reason: str | None = None  # end_turn, max_tokens, stop_sequence, tool_use
    stop_sequence: str | None = None
    usage: Usage


class ErrorDetail(_Body, kw_only=True):
    type: str
    message: str


class ErrorBody(_Body, kw_only=True):
    type: Literal["error"] = "error"
    error: ErrorDetail


# ---- streaming events (`event: <type>` + `data: <json>`) ------------------------------------------


class MessageStart(_Body, kw_only=True):
    type: Literal["message_start"] = "message_start"
    message: Message


class BlockStart(_Body, kw_only=True):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock


class TextDelta(_Body, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class JsonDelta(_Body, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(_Body, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class BlockDelta(_Body, kw_only=True):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | JsonDelta | ThinkingDelta


class BlockStop(_Body, kw_only=True):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopInfo(_Body, kw_only=True):
    stop_reason: str | None
    stop_sequence: str | None = None


class OutputUsage(_Body, kw_only=True):
    output_tokens: int


class MessageDelta(_Body, kw_only=True):
    type: Literal["message_delta"] = "message_delta"
    delta: StopInfo
    usage: OutputUsage


class MessageStop(_Body, kw_only=True):
    type: Literal["message_stop"] = "message_stop"


class ErrorEvent(ErrorBody, kw_only=True):
    pass


MessagesEvent = MessageStart | BlockStart | BlockDelta | BlockStop | MessageDelta | MessageStop | ErrorEvent
