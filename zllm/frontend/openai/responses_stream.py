"""The Responses API's streaming events, out of chat completion chunks (responses.py runs the chat).

    response.created, response.in_progress
    per output item, one open at a time (reasoning, then the message, then each function call):
        response.output_item.added [response.content_part.added]
        response.reasoning_text.delta | response.output_text.delta | response.function_call_arguments.delta ...
        the matching .done [response.content_part.done] response.output_item.done
    response.completed | response.incomplete      (responses.py sends the lifecycle events)

Each event is numbered (`sequence_number`) as it is made; an item announced as added is a copy
(empty), since the item itself grows with its deltas and is sent whole when done.
"""

from __future__ import annotations

import msgspec

from zllm.frontend.openai.protocol import ChatCompletionChunk, DeltaToolCall, UsageInfo
from zllm.frontend.openai.responses_protocol import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    LifecycleEvent,
    MessageItem,
    OutputItem,
    OutputItemEvent,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseEvent,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
    item_id,
)


class EventStream:
    """Chat chunks into the Responses API's typed events: one output item at a time is open."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.sequence = 0
        self.usage: UsageInfo | None = None
        self.finish_reason: str | None = None

    def _numbered(self, event: ResponseEvent) -> ResponseEvent:
        event.sequence_number = self.sequence
        self.sequence += 1
        return event

    def lifecycle(self, kind: str) -> LifecycleEvent:
        return self._numbered(LifecycleEvent(type=kind, response=self.response))

    def feed(self, chunk: ChatCompletionChunk) -> list[ResponseEvent]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        if not chunk.choices:
            return []
        choice = chunk.choices[0]
        delta = choice.delta
        events: list[ResponseEvent] = []
        if delta.reasoning_content:
            events += self._text(ReasoningItem, delta.reasoning_content, "response.reasoning_text.delta")
        if delta.content:
            events += self._text(MessageItem, delta.content, "response.output_text.delta")
        for call in delta.tool_calls or []:
            events += self._call(call)
        if choice.finish_reason is not None:
            self.finish_reason = choice.finish_reason
        return [self._numbered(e) for e in events]

    def _start(self, item: OutputItem) -> list[ResponseEvent]:
        events = self._close()
        self.open = item
        self.items.append(item)
        item.status = "in_progress"
        # As announced: empty (the item itself grows as deltas arrive, and is sent whole when done).
        announced = (
            msgspec.structs.replace(item, content=[]) if hasattr(item, "content") else msgspec.structs.replace(item)
        )
        events.append(OutputItemEvent(type="response.output_item.added", output_index=self._index, item=announced))
        if isinstance(item, MessageItem):
            part = OutputText(text="")
            events.append(
                ContentPartEvent(
                    type="response.content_part.added", item_id=item.id, output_index=self._index, part=part
                )
            )
        return events

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _text(self, kind: type, text: str, event_type: str) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        if not isinstance(self.open, kind):
            if kind is ReasoningItem:
                events += self._start(ReasoningItem(id=item_id("rs"), content=[ReasoningText(text="")]))
            else:
                events += self._start(MessageItem(id=item_id("msg"), content=[OutputText(text="")]))
        self.open.content[0].text += text
        events.append(TextDeltaEvent(type=event_type, item_id=self.open.id, output_index=self._index, delta=text))
        return events

    def _call(self, call: DeltaToolCall) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        if call.id is not None:
            name = call.function.name if call.function else ""
            events += self._start(FunctionCallItem(id=item_id("fc"), call_id=call.id, name=name or "", arguments=""))
        arguments = call.function.arguments if call.function else None
        if arguments and isinstance(self.open, FunctionCallItem):
            self.open.arguments += arguments
            events.append(
                ArgumentsDeltaEvent(
                    type="response.function_call_arguments.delta",
                    item_id=self.open.id,
                    output_index=self._index,
                    delta=arguments,
                )
            )
        return events

    def _close(self) -> list[ResponseEvent]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = "completed"
        index = self.items.index(item)
        events: list[ResponseEvent] = []
        if isinstance(item, ReasoningItem):
            text = item.content[0].text
            events.append(
                TextDoneEvent(type="response.reasoning_text.done", item_id=item.id, output_index=index, text=text)
            )
        elif isinstance(item, MessageItem):
            part = item.content[0]
            events.append(
                TextDoneEvent(type="response.output_text.done", item_id=item.id, output_index=index, text=part.text)
            )
            events.append(
                ContentPartEvent(type="response.content_part.done", item_id=item.id, output_index=index, part=part)
            )
        else:
            events.append(
                ArgumentsDoneEvent(
                    type="response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        events.append(OutputItemEvent(type="response.output_item.done", output_index=index, item=item))
        return events

    def close_all(self) -> list[ResponseEvent]:
        return [self._numbered(e) for e in self._close()]
