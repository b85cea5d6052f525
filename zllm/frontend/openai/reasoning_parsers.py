"""The thinking of reasoning models apart from their answer, whole or as it streams.

    deepseek_r1  [<think>] reasoning </think> answer     the output starts inside the thinking
                                                        (R1's template opens it in the prompt)
    qwen3        <think> reasoning </think> answer      thinking only when the output opens it,
                                                        or the prompt left a <think> open
                                                        (Qwen3-Thinking's template); else all answer

Both split the text exactly at the tags: the reasoning is what lies between them (without the
tags), the answer what follows `</think>`. A thinking block that never closes (max_tokens ran
out) is all reasoning. Tool calls and everything else that reads the answer read only the answer.

Parsers work on text, like the tool-call parsers: `split` maps the text generated so far to what
is safe to show of each part (a possible start of a tag is held back), so streaming sends the
difference from what was sent and the streamed parts concatenate to the non-streamed ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from zllm.frontend.openai.tool_parsers import held_back


@dataclass(slots=True)
class Split:
    reasoning: str | None  # None: the output has no thinking at all
    content: str


class ReasoningParser:
    """One format; an instance serves one request (it knows how the prompt ended)."""

    name = ""
    START, END = "<think>", "</think>"

    def __init__(self, prompt: str) -> None:
        # The prompt's last tag is an open <think>: the template started the thinking.
        self.opened_in_prompt = prompt.rfind(self.START) > prompt.rfind(self.END)

    def thinks(self, text: str, final: bool) -> bool | None:
        """Whether the output starts inside the thinking (None: cannot tell yet)."""
        raise NotImplementedError

    @property
    def thinks_first(self) -> bool:
        """The output is known, before it starts, to begin with thinking: an output constraint
        then applies only after `END` (the engine's grammar sleeps until then)."""
        return True

    def split(self, text: str, final: bool) -> Split:
        thinking = self.thinks(text, final)
        if thinking is None:
            return Split(None, "")
        if not thinking:
            return Split(None, text)
        if not final and self.START.startswith(text):
            return Split("", "")  # maybe the model writes <think> itself: hold it back
        body = text.removeprefix(self.START)
        at = body.find(self.END)
        if at < 0:
            return Split(body if final else held_back(body, self.END), "")
        return Split(body[:at], body[at + len(self.END) :])


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"

    def thinks(self, text: str, final: bool) -> bool | None:
        return True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"

    @property
    def thinks_first(self) -> bool:
        # Otherwise the model may or may not open <think> itself; a grammar from the first token
        # makes it answer at once (as enable_thinking: false would).
        return self.opened_in_prompt

    def thinks(self, text: str, final: bool) -> bool | None:
        if self.opened_in_prompt or text.startswith(self.START):
            return True
        if not final and self.START.startswith(text):
            return None  # "" or a partial "<think>"
        return False


# The --reasoning-parser choices (vLLM's names): the one list the CLI, the config check and the
# docs follow (tests/test_reasoning.py holds them to it). A new format is a class and a line here.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1Parser, Qwen3Parser)
}


def reasoning_parser(name: str, prompt: str) -> ReasoningParser:
    """The parser `--reasoning-parser name` selects, for a request with this prompt text."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name](prompt)


class ReasoningStream:
    """Feeds generated text deltas through a parser; returns the new reasoning and answer text."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        split = self.parser.split(self.text, final)
        reasoning = (split.reasoning or "")[self.sent_reasoning :]
        content = split.content[self.sent_content :]
        self.sent_reasoning += len(reasoning)
        self.sent_content += len(content)
        return reasoning, content
