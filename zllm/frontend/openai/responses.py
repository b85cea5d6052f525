"""`/v1/responses` (OpenAI's Responses API) as a chat completion: the request is translated into a
`ChatCompletionRequest` and run by `ChatCall` (chat template, tool calls, reasoning parser,
structured outputs, streaming), and its answer is translated back into output items and events.

    input (string or items) + instructions + previous response's conversation -> chat messages
    chat message   -> [reasoning item] [message item] [function_call items]
    chat chunks    -> response.created, .in_progress, output_item.added, *.delta, *.done, ...,
                      response.completed (or .incomplete when max_output_tokens ran out)

`previous_response_id` continues a stored response: `ResponseStore` keeps the conversation of the
last `capacity` responses in memory (only with --enable-responses-store, as in vLLM: stored
conversations hold user data and memory).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zllm.frontend.openai.protocol import (
    BadRequestError,
    ChatCompletionRequest,
    ChatMessage,
    ChatResponseMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    ToolCallMessage,
    UsageInfo,
    now_s,
)
from zllm.frontend.openai.responses_protocol import (
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    item_id,
)
from zllm.frontend.openai.responses_stream import EventStream
from zllm.frontend.openai.serving import ChatCall, EngineCall

if TYPE_CHECKING:
    from zllm.frontend.server import FrontendServer

STORE_CAPACITY = 1024  # responses kept for previous_response_id; the oldest is forgotten first


class PreviousResponseNotFound(BadRequestError):
    """previous_response_id names no stored response (404, as OpenAI answers)."""

    status = 404


@dataclass(slots=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]  # input and output messages, without the instructions


class ResponseStore:
    """The last `capacity` responses, for previous_response_id and GET /v1/responses/{id}."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)


# ---- input items -> chat messages -----------------------------------------------------------------


def input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The request's input as chat messages (a string is one user message)."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    if not value:
        raise BadRequestError("input: must not be empty", "input")
    messages: list[ChatMessage] = []
    for index, item in enumerate(value):
        message = _item_message(item, index)
        if message is None:
            continue
        previous = messages[-1] if messages else None
        if message.tool_calls and previous is not None and previous.tool_calls and previous.content is None:
            previous.tool_calls.extend(message.tool_calls)  # parallel calls are one assistant turn
        else:
            messages.append(message)
    return messages


def _item_message(item: dict[str, Any], index: int) -> ChatMessage | None:
    kind = item.get("type", "message")
    try:
        if kind == "message":
            role = item["role"]
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequestError(f"input: item {index} has an unknown role {role!r}", "input")
            return ChatMessage(role="system" if role == "developer" else role, content=_text_of(item["content"], index))
        if kind == "function_call":
            call = ToolCallMessage(
                id=item["call_id"], function=FunctionCall(name=item["name"], arguments=item["arguments"])
            )
            return ChatMessage(role="assistant", tool_calls=[call])
        if kind == "function_call_output":
            output = item["output"]
            return ChatMessage(role="tool", tool_call_id=item["call_id"], content=_text_of(output, index))
    except (KeyError, TypeError) as error:
        raise BadRequestError(f"input: item {index} ({kind}) lacks or mistypes {error}", "input") from None
    if kind == "reasoning":
        return None  # earlier thinking is not shown to the model again (chat templates drop it too)
    raise BadRequestError(f"input: item {index} has an unsupported type {kind!r}", "input")


def _text_of(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TypeError("content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequestError(f"input: item {index} has a {kind!r} part; only text is supported", "input")
        texts.append(part["text"])
    return "\n".join(texts)


# ---- the request -> a chat request ----------------------------------------------------------------


def _chat_tools(request: ResponsesRequest) -> list[ChatTool] | None:
    if not request.tools:
        return None
    for tool in request.tools:
        if tool.type != "function" or not tool.name:
            raise BadRequestError(f"tools: only named function tools are supported, got type {tool.type!r}", "tools")
    return [
        ChatTool(
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            )
        )
        for t in request.tools
    ]


def _tool_choice(request: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = request.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    schema = text_format if text_format.type == "json_schema" else None
    return ResponseFormat(type=text_format.type, json_schema=schema)


def chat_request(request: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
    instructions = [ChatMessage(role="system", content=request.instructions)] if request.instructions else []
    return ChatCompletionRequest(
        messages=instructions + conversation,
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        logit_bias=request.logit_bias,
        stop=request.stop,
        tools=_chat_tools(request),
        tool_choice=_tool_choice(request),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request),
        stream=request.stream,
        stream_options=StreamOptions(include_usage=True) if request.stream else None,
        chat_template_kwargs=request.chat_template_kwargs,
    )


# ---- chat answers -> output items ------------------------------------------------------------------


def output_items(message: ChatResponseMessage) -> list[OutputItem]:
    items: list[OutputItem] = []
    if message.reasoning_content is not None:
        items.append(ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=message.reasoning_content)]))
    if message.content:
        items.append(MessageItem(id=item_id("msg"), content=[OutputText(text=message.content)]))
    for call in message.tool_calls:
        items.append(
            FunctionCallItem(
                id=item_id("fc"), call_id=call.id, name=call.function.name, arguments=call.function.arguments
            )
        )
    return items


def _output_message(items: list[OutputItem]) -> ChatMessage:
    """The answer as the assistant turn a later request continues from."""
    text = "".join(part.text for item in items if isinstance(item, MessageItem) for part in item.content)
    calls = [
        ToolCallMessage(id=i.call_id, function=FunctionCall(name=i.name, arguments=i.arguments))
        for i in items
        if isinstance(i, FunctionCallItem)
    ]
    return ChatMessage(role="assistant", content=text or None if calls else text, tool_calls=calls or None)


def _usage(usage: UsageInfo | None) -> ResponseUsage | None:
    if usage is None:
        return None
    return ResponseUsage(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens
    )


@dataclass(slots=True)
class ResponsesCall:
    """One /v1/responses request, translated and ready to run."""

    request: ResponsesRequest
    chat: ChatCall
    conversation: list[ChatMessage]  # what a later previous_response_id continues (with the output)
    store: ResponseStore | None
    id: str = field(default_factory=lambda: item_id("resp"))
    created: int = field(default_factory=now_s)
    named_events = True  # SSE events carry `event: <type>`; no [DONE]

    @classmethod
    def build(
        cls, server: FrontendServer, request: ResponsesRequest, model: str, store: ResponseStore | None
    ) -> ResponsesCall:
        conversation = _history(request, store) + input_messages(request.input)
        chat = ChatCall.build(server, chat_request(request, conversation), model)
        return cls(request, chat, conversation, store if request.store else None)

    def engine_call(self, server: FrontendServer) -> EngineCall:
        return self.chat.engine_call(server)

    def _response(
        self, status: str, output: list[OutputItem], usage: UsageInfo | None, finish: str | None
    ) -> ResponseObject:
        request = self.request
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status if finish != "length" else "incomplete",
            model=self.chat.model,
            output=output,
            usage=_usage(usage),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if finish == "length" else None,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            tools=request.tools or [],
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id,
            store=self.store is not None,
            metadata=request.metadata,
        )

    def _remember(self, response: ResponseObject) -> None:
        if self.store is not None:
            conversation = self.conversation + [_output_message(response.output)]
            self.store.put(StoredResponse(response, conversation))

    async def response(self, server: FrontendServer, call: EngineCall) -> ResponseObject:
        answer = await self.chat.response(server, call)
        choice = answer.choices[0]
        result = self._response("completed", output_items(choice.message), answer.usage, choice.finish_reason)
        self._remember(result)
        return result

    async def chunks(self, server: FrontendServer, call: EngineCall) -> AsyncIterator[ResponseEvent]:
        events = EventStream(self._response("in_progress", [], None, None))
        yield events.lifecycle("response.created")
        yield events.lifecycle("response.in_progress")
        async for chunk in self.chat.chunks(server, call):
            for event in events.feed(chunk):
                yield event
        for event in events.close_all():
            yield event
        final = self._response("completed", events.items, events.usage, events.finish_reason)
        self._remember(final)
        events.response = final
        yield events.lifecycle("response.incomplete" if final.status == "incomplete" else "response.completed")

    @staticmethod
    def error_event(message: str, code: str | None, param: str | None) -> ErrorEvent:
        return ErrorEvent(type="error", message=message, code=code, param=param)


def _history(request: ResponsesRequest, store: ResponseStore | None) -> list[ChatMessage]:
    if request.previous_response_id is None:
        return []
    if store is None:
        raise BadRequestError(
            "previous_response_id: responses are not stored on this server (start it with --enable-responses-store)",
            "previous_response_id",
        )
    stored = store.get(request.previous_response_id)
    if stored is None:
        raise PreviousResponseNotFound(
            f"previous_response_id: no stored response {request.previous_response_id!r}", "previous_response_id"
        )
    return list(stored.conversation)
