"""OpenAI requests in, engine requests through the frontend server, OpenAI responses out.

One API call (a prompt list times `n`) becomes one in-process client of the FrontendServer, so it
takes the same path as a ZMQ client's requests: the same validation, stop strings, streaming
hold-back and engine-dead handling. Leaving the call — finished, failed, or the HTTP client
gone — closes that client, which aborts whatever is still running in the engine.

    choice index = prompt index * n + sample index        (OpenAI's order for batched prompts)
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from zllm.frontend.openai_protocol import (
    BadRequest,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    TextContent,
    UsageInfo,
    now_s,
    param_of,
)
from zllm.frontend.tokenizer import chat_prompt
from zllm.ipc.messages import ClientGenerate, ServerError, ServerOutput
from zllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from zllm.frontend.server import FrontendServer


class EngineError(Exception):
    """The engine side failed a request: `kind` is ServerError's (bad_request, engine_dead, ...)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class Prompt:
    text: str | None  # None when given as token ids (decoded only if echo needs it)
    token_ids: list[int]


@dataclass(slots=True)
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class EngineCall:
    """The engine requests of one API call, as one in-process client of the frontend server."""

    def __init__(self, server: FrontendServer, prompts: list[Prompt], sampling: SamplingParams, n: int) -> None:
        self.server = server
        self.prompts = prompts
        self.sampling = msgspec.to_builtins(sampling)  # non-default fields, as a client sends them
        self.n = n
        self.choices = [_Choice() for _ in range(len(prompts) * n)]
        self._identity: bytes | None = None

    async def __aenter__(self) -> EngineCall:
        """Submit every request; a refusal (bad input, engine dead, overloaded) raises EngineError
        here, before any response has started."""
        self._identity, self._inbox = self.server.open_local_client()
        try:
            for index, prompt in enumerate(p for p in self.prompts for _ in range(self.n)):
                message = ClientGenerate(str(index), prompt_token_ids=prompt.token_ids, sampling=self.sampling)
                await self.server.submit(self._identity, message)
            self._raise_early_refusal()
        except BaseException:
            await self.server.close_local_client(self._identity)
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.server.close_local_client(self._identity)

    def _raise_early_refusal(self) -> None:
        # The server answers a refused request at once (synchronously), so any refusal is
        # already queued; look at what is there, and keep it in order for outputs().
        arrived = [self._inbox.get_nowait() for _ in range(self._inbox.qsize())]
        for message in arrived:
            if isinstance(message, ServerError):
                raise EngineError(message.message, message.kind)
        for message in arrived:
            self._inbox.put_nowait(message)

    async def outputs(self) -> AsyncIterator[tuple[int, ServerOutput]]:
        """Each delta with its choice index, until every choice has finished."""
        unfinished = len(self.choices)
        while unfinished:
            message = await self._inbox.get()
            if isinstance(message, ServerError):
                raise EngineError(message.message, message.kind)
            if not isinstance(message, ServerOutput):
                continue
            index = int(message.request_id)
            choice = self.choices[index]
            choice.text.append(message.text)
            choice.num_tokens += len(message.token_ids)
            if message.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = message.finish_reason, message.stop_reason
                unfinished -= 1
            yield index, message

    async def wait(self) -> None:
        async for _ in self.outputs():
            pass

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)


# ---- from requests to engine inputs ---------------------------------------------------------------

_NEUTRAL_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
_UNEXPECTED_ARGUMENT = re.compile(r"argument '(\w+)'")


def sampling_params(request: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                    logprobs: int | None, max_n: int) -> SamplingParams:
    """vLLM's SamplingParams from the request's fields; any refusal is a BadRequest naming the field."""
    if request.stream_options is not None and not request.stream:
        raise BadRequest("stream_options: only allowed with stream: true", "stream_options")
    if not 1 <= request.n <= max_n:
        raise BadRequest(f"n: must be between 1 and {max_n}, got {request.n}", "n")
    fields: dict[str, Any] = dict(
        n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        min_p=request.min_p, seed=request.seed, min_tokens=request.min_tokens, stop=request.stop,
        stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty, logit_bias=_logit_bias(request.logit_bias),
        logprobs=logprobs,
    )
    fields = {k: v for k, v in fields.items() if v is not None and v != _NEUTRAL_DEFAULTS.get(k, ...)}
    try:
        return SamplingParams(max_tokens=max_tokens, **fields)
    except ValueError as error:
        raise BadRequest(str(error), param_of(str(error))) from None
    except TypeError as error:  # a field this engine's SamplingParams does not have
        match = _UNEXPECTED_ARGUMENT.search(str(error))
        name = match.group(1) if match else None
        raise BadRequest(f"{name}: not supported by this server", name) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise BadRequest("logit_bias: keys must be token ids", "logit_bias") from None


def completion_prompts(server: FrontendServer, prompt: str | list) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [_text_prompt(server, prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [_text_prompt(server, p) for p in prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [Prompt(None, list(prompt))]
    if prompt and all(isinstance(p, list) and p for p in prompt):
        return [Prompt(None, list(p)) for p in prompt]
    raise BadRequest("prompt: must be a non-empty string, list of strings, list of token ids or list of "
                     "non-empty token-id lists", "prompt")


def _text_prompt(server: FrontendServer, text: str) -> Prompt:
    if not text:
        raise BadRequest("prompt: must not be empty", "prompt")
    return Prompt(text, server.tokenizer.encode(text))


def conversation_prompt(server: FrontendServer, request: ChatCompletionRequest) -> Prompt:
    """The messages rendered through the model's chat template (transformers)."""
    messages = [_message_dict(m) for m in request.messages]
    try:
        rendered = chat_prompt(server.tokenizer, messages, request.add_generation_prompt)
    except ValueError as error:
        raise BadRequest(str(error), "messages") from None
    return Prompt(rendered["prompt"], rendered["prompt_token_ids"])


def _message_dict(message) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        if any(not isinstance(part, TextContent) for part in content):
            raise BadRequest("messages: only text content parts are supported by this model", "messages")
        content = "\n".join(part.text for part in content)
    result = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    return result


def check_context(prompts: list[Prompt], max_tokens: int | None, max_model_len: int, field_name: str) -> None:
    """Every prompt plus max_tokens must fit the context, as OpenAI's API demands (400, not truncation)."""
    for prompt in prompts:
        wanted = len(prompt.token_ids) + (max_tokens or 1)
        if wanted > max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(prompt.token_ids)} in the {field_name}, {max_tokens or 1} in the "
                f"completion). Please reduce the length of the {field_name} or completion.",
                field_name if max_tokens is None or len(prompt.token_ids) >= max_model_len else "max_tokens",
                "context_length_exceeded",
            )


def request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


# ---- completions ----------------------------------------------------------------------------------


@dataclass(slots=True)
class CompletionCall:
    """One /v1/completions request, validated and ready to run."""

    request: CompletionRequest
    model: str
    prompts: list[Prompt]
    sampling: SamplingParams
    id: str = field(default_factory=lambda: request_id("cmpl"))
    created: int = field(default_factory=now_s)

    @classmethod
    def build(cls, server: FrontendServer, request: CompletionRequest, model: str) -> CompletionCall:
        if request.suffix is not None:
            raise BadRequest("suffix: not supported", "suffix")
        prompts = completion_prompts(server, request.prompt)
        check_context(prompts, request.max_tokens, server.config.max_model_len, "prompt")
        sampling = sampling_params(request, request.max_tokens, request.logprobs, server.config.max_n)
        return cls(request, model, prompts, sampling)

    def engine_call(self, server: FrontendServer) -> EngineCall:
        return EngineCall(server, self.prompts, self.sampling, self.request.n)

    def _echo(self, server: FrontendServer, index: int) -> str:
        prompt = self.prompts[index // self.request.n]
        if prompt.text is None:
            prompt.text = server.tokenizer.decode(prompt.token_ids)
        return prompt.text

    async def response(self, server: FrontendServer, call: EngineCall) -> CompletionResponse:
        await call.wait()
        choices = [
            CompletionChoice(
                index=i,
                text=(self._echo(server, i) if self.request.echo else "") + "".join(c.text),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for i, c in enumerate(call.choices)
        ]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=call.usage())

    async def chunks(self, server: FrontendServer, call: EngineCall) -> AsyncIterator[CompletionResponse]:
        options = self.request.stream_options
        echoed: set[int] = set()
        async for index, out in call.outputs():
            text = out.text
            if self.request.echo and index not in echoed:
                echoed.add(index)
                text = self._echo(server, index) + text
            if not text and out.finish_reason is None:
                continue  # nothing to show yet (held back while a stop string may match)
            choice = CompletionChoice(index=index, text=text, finish_reason=out.finish_reason,
                                      stop_reason=out.stop_reason)
            usage = call.usage() if options and options.continuous_usage_stats else None
            yield CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                     usage=usage)
        if options and options.include_usage:
            yield CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                     usage=call.usage())


# ---- chat completions -----------------------------------------------------------------------------


@dataclass(slots=True)
class ChatCall:
    """One /v1/chat/completions request, validated and ready to run."""

    request: ChatCompletionRequest
    model: str
    prompt: Prompt
    sampling: SamplingParams
    id: str = field(default_factory=lambda: request_id("chatcmpl"))
    created: int = field(default_factory=now_s)

    @classmethod
    def build(cls, server: FrontendServer, request: ChatCompletionRequest, model: str) -> ChatCall:
        if request.top_logprobs is not None and not request.logprobs:
            raise BadRequest("top_logprobs: needs logprobs: true", "top_logprobs")
        prompt = conversation_prompt(server, request)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        check_context([prompt], max_tokens, server.config.max_model_len, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        sampling = sampling_params(request, max_tokens, logprobs, server.config.max_n)
        return cls(request, model, prompt, sampling)

    def engine_call(self, server: FrontendServer) -> EngineCall:
        return EngineCall(server, [self.prompt], self.sampling, self.request.n)

    async def response(self, server: FrontendServer, call: EngineCall) -> ChatCompletionResponse:
        await call.wait()
        choices = [
            ChatChoice(index=i, message=ChatResponseMessage(content="".join(c.text)), finish_reason=c.finish_reason,
                       stop_reason=c.stop_reason)
            for i, c in enumerate(call.choices)
        ]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=call.usage())

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    async def chunks(self, server: FrontendServer, call: EngineCall) -> AsyncIterator[ChatCompletionChunk]:
        options = self.request.stream_options
        # The role comes first, once per choice, as OpenAI sends it.
        for index in range(len(call.choices)):
            yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for index, out in call.outputs():
            if not out.text and out.finish_reason is None:
                continue
            delta = DeltaMessage(content=out.text) if out.text else DeltaMessage()
            choice = ChatStreamChoice(index=index, delta=delta, finish_reason=out.finish_reason,
                                      stop_reason=out.stop_reason)
            yield self._chunk([choice], call.usage() if options and options.continuous_usage_stats else None)
        if options and options.include_usage:
            yield self._chunk([], call.usage())
