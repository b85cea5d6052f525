"""`/v1/messages` (Anthropic's Messages API) as a chat completion: the request is translated into a
`ChatCompletionRequest` and run by `ChatCall` (chat template, tool calls, reasoning parser,
streaming), and its answer is translated back into content blocks and Anthropic's events.

    system + messages (text, tool_use, tool_result blocks) -> chat messages (tool results: role tool)
    tools (input_schema) / tool_choice auto|any|tool|none   -> chat tools / auto|required|named|none
    chat message -> [thinking] [text] [tool_use ...] blocks; finish reason -> stop_reason
    chat chunks  -> message_start, content_block_start/delta/stop ..., message_delta, message_stop
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zllm.frontend.openai.messages_protocol import (
    BlockDelta,
    BlockStart,
    BlockStop,
    ErrorDetail,
    ErrorEvent,
    InputMessage,
    JsonDelta,
    Message,
    MessageDelta,
    MessagesEvent,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutputBlock,
    OutputUsage,
    StopInfo,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
)
from zllm.frontend.openai.protocol import (
    BadRequestError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChatResponseMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    StreamOptions,
    ToolCallMessage,
)
from zllm.frontend.openai.serving import ChatCall, EngineCall

if TYPE_CHECKING:
    from zllm.frontend.server import FrontendServer

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error")


# ---- the request -> a chat request ----------------------------------------------------------------


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _chat_messages(message: InputMessage) -> list[ChatMessage]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages
    (first, as Anthropic orders them), an assistant turn's tool_use blocks its tool calls."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    texts = [block.text for block in message.content if isinstance(block, TextBlock)]
    results = [
        ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=_text(block.content))
        for block in message.content
        if isinstance(block, ToolResultBlock)
    ]
    calls = [
        ToolCallMessage(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input)))
        for block in message.content
        if isinstance(block, ToolUseBlock)
    ]
    if message.role == "user" and calls:
        raise BadRequestError("messages: tool_use blocks belong to assistant messages", "messages")
    if message.role == "assistant" and results:
        raise BadRequestError("messages: tool_result blocks belong to user messages", "messages")
    text = "\n".join(texts)
    if calls:
        return [ChatMessage(role="assistant", content=text or None, tool_calls=calls)]
    return results + ([ChatMessage(role=message.role, content=text)] if texts or not results else [])


def _tool_choice(request: MessagesRequest) -> str | NamedToolChoice | None:
    choice = request.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise BadRequestError('tool_choice: type "tool" needs a name', "tool_choice")
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    if not request.messages:
        raise BadRequestError("messages: must not be empty", "messages")
    system = [ChatMessage(role="system", content=_text(request.system))] if request.system else []
    tools = [
        ChatTool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
        for t in request.tools or []
    ]
    parallel = False if request.tool_choice and request.tool_choice.disable_parallel_tool_use else None
    return ChatCompletionRequest(
        messages=system + [m for message in request.messages for m in _chat_messages(message)],
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        logit_bias=request.logit_bias,
        stop=request.stop_sequences,
        tools=tools or None,
        tool_choice=_tool_choice(request),
        parallel_tool_calls=parallel,
        stream=request.stream,
        stream_options=StreamOptions(include_usage=True) if request.stream else None,
        chat_template_kwargs=request.chat_template_kwargs,
    )


# ---- chat answers -> Anthropic's ------------------------------------------------------------------


def _blocks(message: ChatResponseMessage) -> list[OutputBlock]:
    blocks: list[OutputBlock] = []
    if message.reasoning_content is not None:
        blocks.append(ThinkingBlock(thinking=message.reasoning_content))
    if message.content:
        blocks.append(TextBlock(text=message.content))
    for call in message.tool_calls:
        blocks.append(ToolUseBlock(id=call.id, name=call.function.name, input=json.loads(call.function.arguments)))
    return blocks


def stop_reason(finish_reason: str | None, stopped_by: int | str | None) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat finish reason (and what stopped it)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return ("end_turn", None) if finish_reason is not None else (None, None)


@dataclass(slots=True)
class MessagesCall:
    """One /v1/messages request, translated and ready to run."""

    request: MessagesRequest
    chat: ChatCall
    id: str
    named_events = True  # SSE events carry `event: <type>`; no [DONE]

    @classmethod
    def build(cls, server: FrontendServer, request: MessagesRequest, model: str) -> MessagesCall:
        return cls(request, ChatCall.build(server, chat_request(request), model), f"msg_{secrets.token_hex(12)}")

    def engine_call(self, server: FrontendServer) -> EngineCall:
        return self.chat.engine_call(server)

    async def response(self, server: FrontendServer, call: EngineCall) -> Message:
        answer = await self.chat.response(server, call)
        choice: ChatChoice = answer.choices[0]
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
        usage = Usage(input_tokens=answer.usage.prompt_tokens, output_tokens=answer.usage.completion_tokens)
        return Message(
            id=self.id,
            model=self.chat.model,
            content=_blocks(choice.message),
            stop_reason=reason,
            stop_sequence=sequence,
            usage=usage,
        )

    async def chunks(self, server: FrontendServer, call: EngineCall) -> AsyncIterator[MessagesEvent]:
        usage = Usage(input_tokens=len(self.chat.prompt.token_ids), output_tokens=0)
        yield MessageStart(message=Message(id=self.id, model=self.chat.model, usage=usage))
        blocks = _BlockStream()
        async for chunk in self.chat.chunks(server, call):
            for event in blocks.feed(chunk):
                yield event
        for event in blocks.close():
            yield event
        reason, sequence = stop_reason(blocks.finish_reason, blocks.stopped_by)
        yield MessageDelta(
            delta=StopInfo(stop_reason=reason, stop_sequence=sequence), usage=OutputUsage(output_tokens=blocks.tokens)
        )
        yield MessageStop()

    @staticmethod
    def error_event(message: str, code: str | None, param: str | None) -> ErrorEvent:
        return ErrorEvent(error=ErrorDetail(type="overloaded_error" if code else "api_error", message=message))


class _BlockStream:
    """Chat chunks into content blocks, one open at a time: thinking, text, then tool_use."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the open block's kind: thinking, text or tool_use
        self.finish_reason: str | None = None
        self.stopped_by: int | str | None = None
        self.tokens = 0

    def feed(self, chunk: ChatCompletionChunk) -> list[MessagesEvent]:
        if chunk.usage is not None:
            self.tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            return []
        choice = chunk.choices[0]
        delta = choice.delta
        events: list[MessagesEvent] = []
        if delta.reasoning_content:
            events += self._delta(
                "thinking", ThinkingBlock(thinking=""), ThinkingDelta(thinking=delta.reasoning_content)
            )
        if delta.content:
            events += self._delta("text", TextBlock(text=""), TextDelta(text=delta.content))
        for tool_call in delta.tool_calls or []:
            if tool_call.id is not None:
                events += self._start("tool_use", ToolUseBlock(id=tool_call.id, name=tool_call.function.name, input={}))
            if tool_call.function is not None and tool_call.function.arguments:
                events.append(BlockDelta(index=self.index, delta=JsonDelta(partial_json=tool_call.function.arguments)))
        if choice.finish_reason is not None:
            self.finish_reason, self.stopped_by = choice.finish_reason, choice.stop_reason
        return events

    def _delta(self, kind: str, empty: OutputBlock, delta: TextDelta | ThinkingDelta) -> list[MessagesEvent]:
        events = self._start(kind, empty) if self.open != kind else []
        return events + [BlockDelta(index=self.index, delta=delta)]

    def _start(self, kind: str, block: OutputBlock) -> list[MessagesEvent]:
        events = self.close()
        self.index += 1
        self.open = kind
        return events + [BlockStart(index=self.index, content_block=block)]

    def close(self) -> list[MessagesEvent]:
        if self.open is None:
            return []
        self.open = None
        return [BlockStop(index=self.index)]
