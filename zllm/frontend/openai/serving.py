"""OpenAI requests in, engine requests through the frontend server, OpenAI responses out.

One API call (a prompt list times `n`) becomes one in-process client of the FrontendServer, so it
takes the same path as a ZMQ client's requests: the same validation, stop strings, streaming
hold-back and engine-dead handling. Leaving the call — finished, failed, or the HTTP client
gone — closes that client, which aborts whatever is still running in the engine.

    choice index = prompt index * n + sample index        (OpenAI's order for batched prompts)
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from zllm.frontend.openai.constraints import structured_outputs_of, tool_choice_schema
from zllm.frontend.openai.media import load_images
from zllm.frontend.openai.protocol import (
    BadRequestError,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseToolCall,
    TextContent,
    TopLogprob,
    UsageInfo,
    now_s,
    param_of,
)
from zllm.frontend.openai.reasoning_parsers import ReasoningParser, ReasoningStream, reasoning_parser
from zllm.frontend.openai.tool_parsers import (
    CallDelta,
    NamedParser,
    RequiredParser,
    ToolCallStream,
    ToolParser,
    tool_parser,
)
from zllm.frontend.parallel_sampling import best_of_indices
from zllm.frontend.tokenizer import chat_prompt
from zllm.ipc.messages import ClientGenerate, ImageInput, ServerError, ServerOutput
from zllm.outputs import Logprob, PromptLogprobs, SampleLogprobs
from zllm.sampling_params import SamplingParams, StructuredOutputsParams, check_truncate_prompt_tokens

if TYPE_CHECKING:
    from zllm.frontend.server import FrontendServer


NO_TOKENIZER = "{field}: this server runs without a tokenizer (--skip-tokenizer-init)"


class FrontendRequestError(Exception):
    """Raised in the HTTP layer when the frontend refused or failed a request (through its local
    client): `kind` is ServerError's (bad_request, engine_dead, ...)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class Prompt:
    text: str | None  # None when given as token ids (decoded only if echo needs it)
    token_ids: list[int]
    # A chat's image parts, in order (their placeholders are in the text), then the images
    # processed: token_ids expanded, one ImageInput each (attach_images).
    image_urls: list[str] = field(default_factory=list)
    mm_inputs: list[ImageInput] = field(default_factory=list)


@dataclass(slots=True)
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


class EngineCall:
    """The engine requests of one API call, as one in-process client of the frontend server:
    one request per prompt, each with its n completions (the server fans them out).

    best_of: the engine generates sampling.n candidates per prompt and `keep_best` leaves the
    `keep_n` with the highest cumulative logprob (the usage still counts every generated token)."""

    def __init__(
        self,
        server: FrontendServer,
        prompts: list[Prompt],
        sampling: SamplingParams,
        keep_n: int | None = None,
        model: str | None = None,
    ) -> None:
        """model: the served name the request asked for: the base model's, or a LoRA adapter's."""
        self.server = server
        self.lora_name = model if model is not None and model != server.config.model_name else None
        self.prompts = prompts
        self.sampling = msgspec.to_builtins(sampling)  # non-default fields, as a client sends them
        self.n = sampling.n
        self.keep_n = keep_n or sampling.n
        self.choices = [_Choice() for _ in range(len(prompts) * self.n)]
        self._dropped_tokens = 0
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
        self._identity: bytes | None = None

    async def __aenter__(self) -> EngineCall:
        """Submit every request; a refusal (bad input, engine dead, overloaded) raises FrontendRequestError
        here, before any response has started."""
        self._identity, self._inbox = self.server.open_local_client()
        try:
            for index, prompt in enumerate(self.prompts):
                message = ClientGenerate(
                    str(index), prompt_token_ids=prompt.token_ids, sampling=self.sampling, lora_name=self.lora_name
                )
                await self.server.submit(self._identity, message, mm_inputs=prompt.mm_inputs)
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
                raise FrontendRequestError(message.message, message.kind)
        for message in arrived:
            self._inbox.put_nowait(message)

    async def outputs(self) -> AsyncIterator[tuple[int, ServerOutput]]:
        """Each delta with its choice index, until every request has finished."""
        unfinished = len(self.prompts)
        while unfinished:
            message = await self._inbox.get()
            if isinstance(message, ServerError):
                raise FrontendRequestError(message.message, message.kind)
            if not isinstance(message, ServerOutput):
                continue
            prompt_index = int(message.request_id)
            index = prompt_index * self.n + message.index
            self._record(self.choices[index], message)
            if message.prompt_logprobs is not None:
                self.prompt_logprobs[prompt_index] = message.prompt_logprobs
            unfinished -= message.finished
            yield index, message

    @staticmethod
    def _record(choice: _Choice, message: ServerOutput) -> None:
        choice.text.append(message.text)
        choice.token_ids.extend(message.token_ids)
        choice.logprobs.extend(message.logprobs or ())
        if message.cumulative_logprob is not None:
            choice.cumulative_logprob = message.cumulative_logprob
        if message.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = message.finish_reason, message.stop_reason

    async def wait(self) -> None:
        """Until every request has finished; then only the best `keep_n` choices per prompt remain."""
        async for _ in self.outputs():
            pass
        self._keep_best()

    def _keep_best(self) -> None:
        if self.keep_n == self.n:
            return
        kept = []
        for start in range(0, len(self.choices), self.n):
            candidates = self.choices[start : start + self.n]
            best = best_of_indices([c.cumulative_logprob for c in candidates], self.keep_n)
            kept += [candidates[i] for i in best]
            self._dropped_tokens += sum(len(c.token_ids) for c in candidates) - sum(
                len(candidates[i].token_ids) for i in best
            )
        self.choices, self.n = kept, self.keep_n

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for c in self.choices) + self._dropped_tokens
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


# ---- from requests to engine inputs ---------------------------------------------------------------


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    skip_special_tokens: bool | None = None,
) -> SamplingParams:
    """vLLM's SamplingParams from the request's fields; any refusal is a BadRequestError naming the field.
    (Limits that depend on the engine, such as max_n and max_logprobs, are the server's to check.)
    With best_of > n the engine generates best_of completions, with logprobs (at least the sampled
    token's) so that their cumulative logprobs can be compared."""
    if request.stream_options is not None and not request.stream:
        raise BadRequestError("stream_options: only allowed with stream: true", "stream_options")
    n = _best_of(request)
    if n > request.n and logprobs is None:
        logprobs = 0
    if request.skip_special_tokens is not None:
        skip_special_tokens = request.skip_special_tokens
    fields: dict[str, Any] = dict(
        n=n,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        min_tokens=request.min_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=_logit_bias(request.logit_bias),
        bad_words=request.bad_words,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
    )
    try:
        return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in fields.items() if v is not None})
    except ValueError as error:
        raise BadRequestError(str(error), param_of(str(error))) from None


def _best_of(request: CompletionRequest | ChatCompletionRequest) -> int:
    """How many completions per prompt the engine generates: best_of (>= n), else n."""
    if request.best_of is None or request.best_of == request.n:
        return request.n
    if request.best_of < request.n:
        raise BadRequestError(f"best_of: must be >= n ({request.n}), got {request.best_of}", "best_of")
    if request.stream:
        raise BadRequestError(
            "best_of: greater than n cannot be streamed (the best are known only at the end)", "best_of"
        )
    return request.best_of


def check_best_of(server: FrontendServer, request: CompletionRequest | ChatCompletionRequest) -> None:
    if request.best_of is not None and request.best_of > server.config.max_n:
        raise BadRequestError(
            f"best_of: must be at most max_n ({server.config.max_n}), got {request.best_of}", "best_of"
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise BadRequestError("logit_bias: keys must be token ids", "logit_bias") from None


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
    raise BadRequestError(
        "prompt: must be a non-empty string, list of strings, list of token ids or list of non-empty token-id lists",
        "prompt",
    )


def _text_prompt(server: FrontendServer, text: str) -> Prompt:
    if not text:
        raise BadRequestError("prompt: must not be empty", "prompt")
    if server.tokenizer is None:
        raise BadRequestError(NO_TOKENIZER.format(field="prompt") + ": send token ids", "prompt")
    return Prompt(text, server.tokenizer.encode(text))


def conversation_prompt(server: FrontendServer, request: ChatCompletionRequest) -> Prompt:
    """The messages (and tools) rendered through the model's chat template (transformers)."""
    image_urls: list[str] = []
    messages = [_message_dict(m, server, image_urls) for m in request.messages]
    tools = [msgspec.to_builtins(tool) for tool in request.tools] if request.tools else None
    try:
        rendered = chat_prompt(
            server.tokenizer,
            messages,
            request.add_generation_prompt,
            tools=tools,
            template_kwargs=request.chat_template_kwargs,
        )
    except ValueError as error:
        raise BadRequestError(str(error), param_of(str(error)) or "messages") from None
    return Prompt(rendered["prompt"], rendered["prompt_token_ids"], image_urls)


async def attach_images(server: FrontendServer, prompt: Prompt) -> None:
    """Load a chat's images and run the model's image processor on them (off the serving loop):
    the prompt's placeholders expanded, its ImageInputs attached."""
    if not prompt.image_urls:
        return
    images = await load_images(prompt.image_urls, server.config)
    loop = asyncio.get_running_loop()
    try:
        prompt.token_ids, prompt.mm_inputs = await loop.run_in_executor(
            None, server.processor.images.expand, prompt.token_ids, images
        )
    except ValueError as error:
        raise BadRequestError(str(error), "messages") from None
    check_context([prompt], None, server.config.max_model_len, "messages")


def _message_dict(message, server: FrontendServer, image_urls: list[str]) -> dict[str, Any]:
    """A message as chat templates read it; an image part becomes the model's placeholder text
    (its URL joins image_urls)."""
    content = message.content
    if isinstance(content, list):
        content = "\n".join(_part_text(part, server, image_urls) for part in content)
    result = {"role": message.role, "content": content or ""}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        result["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    return result


def _part_text(part, server: FrontendServer, image_urls: list[str]) -> str:
    if isinstance(part, TextContent):
        return part.text
    images = server.processor.images
    if images is None:
        raise BadRequestError(
            "messages: image_url parts need a vision-language model; this one takes text only", "messages"
        )
    image_urls.append(part.image_url.get("url") if isinstance(part.image_url, dict) else None)
    try:
        images.check_count(len(image_urls))
    except ValueError as error:
        raise BadRequestError(str(error), "messages") from None
    return images.placeholder


def _template_tool_call(call) -> dict[str, Any]:
    """A past call as chat templates read it: arguments as an object (OpenAI sends JSON text;
    templates such as Hermes' and Llama's serialise them with `tojson`), as vLLM passes them."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise BadRequestError(f"messages: tool call {call.id!r} has arguments that are not JSON", "messages") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def kept_tokens(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens checked at the edge: how many of a prompt's last tokens to
    keep (-1: max_model_len); None: all. 0, below -1 or over max_model_len is a 400."""
    if truncate_prompt_tokens is None:
        return None
    try:
        check_truncate_prompt_tokens(truncate_prompt_tokens)
    except ValueError as error:
        raise BadRequestError(str(error), "truncate_prompt_tokens") from None
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > max_model_len:
        raise BadRequestError(
            f"truncate_prompt_tokens: {keep} exceeds the model's max_model_len ({max_model_len})",
            "truncate_prompt_tokens",
        )
    return keep


def truncate_prompts(
    server: FrontendServer, prompts: list[Prompt], truncate_prompt_tokens: int | None, texts: bool
) -> None:
    """Each prompt's last k tokens, before the context check (as vLLM truncates at tokenization).
    texts: a prompt's text is tokenized again with left truncation (its BOS kept, as vLLM's
    tokenizer call keeps it); else (token ids, a rendered chat) the ids are sliced. A truncated
    prompt's text is decoded again if echo needs it."""
    keep = kept_tokens(truncate_prompt_tokens, server.config.max_model_len)
    if keep is None:
        return
    for prompt in prompts:
        if prompt.image_urls:
            raise BadRequestError("truncate_prompt_tokens: not supported with images", "truncate_prompt_tokens")
        if len(prompt.token_ids) > keep:
            text = prompt.text if texts else None
            prompt.token_ids, prompt.text = server.processor.truncated(prompt.token_ids, keep, text), None


def check_context(prompts: list[Prompt], max_tokens: int | None, max_model_len: int, field_name: str) -> None:
    """Every prompt plus max_tokens must fit the context, as OpenAI's API demands (400, not truncation)."""
    for prompt in prompts:
        wanted = len(prompt.token_ids) + (max_tokens or 1)
        if wanted > max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({len(prompt.token_ids)} in the {field_name}, {max_tokens or 1} in the "
                f"completion). Please reduce the length of the {field_name} or completion.",
                field_name if max_tokens is None or len(prompt.token_ids) >= max_model_len else "max_tokens",
                "context_length_exceeded",
            )


def request_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


# ---- logprobs in OpenAI's forms --------------------------------------------------------------------


def _chosen(position: dict[int, Logprob]) -> tuple[int, Logprob]:
    return next(iter(position.items()))  # the chosen (sampled or prompt) token comes first


def decoded(server: FrontendServer, token_ids: list[int]) -> str:
    """The text of token ids; "" on a server without a tokenizer (--skip-tokenizer-init)."""
    return server.tokenizer.decode(token_ids) if server.tokenizer is not None else ""


def _token_text(server: FrontendServer, token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else decoded(server, [token_id])


def completion_logprobs(
    server: FrontendServer, positions: list[dict[int, Logprob] | None], prompt_ids: list[int], offset: int
) -> CompletionLogprobs:
    """Completions' form: parallel lists of token texts, their logprobs, the top alternatives
    (token text -> logprob) and each token's character offset in the text (from `offset`).
    A None position (the first prompt token, when echoing) has no logprob."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for i, position in enumerate(positions):
        if position is None:
            token = decoded(server, [prompt_ids[i]])
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            token_id, chosen = _chosen(position)
            token = _token_text(server, token_id, chosen)
            result.token_logprobs.append(chosen.logprob)
            result.top_logprobs.append({_token_text(server, t, lp): lp.logprob for t, lp in position.items()})
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(server: FrontendServer, positions: SampleLogprobs, num_top: int) -> ChatLogprobs:
    """Chat's form: per token its text, logprob and UTF-8 bytes, with the `num_top` most likely."""

    def entry(token_id: int, logprob: Logprob) -> TopLogprob:
        token = _token_text(server, token_id, logprob)
        return TopLogprob(token=token, logprob=logprob.logprob, bytes=list(token.encode()))

    content = []
    for position in positions:
        chosen = entry(*_chosen(position))
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        top = [entry(t, lp) for t, lp in ranked if lp.rank is not None and lp.rank <= num_top][:num_top]
        content.append(
            ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=top)
        )
    return ChatLogprobs(content=content)


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
            raise BadRequestError("suffix: not supported", "suffix")
        echo_logprobs = request.echo and request.logprobs is not None
        if echo_logprobs and request.stream:
            raise BadRequestError("echo: with logprobs, only without stream", "echo")
        check_best_of(server, request)
        prompts = completion_prompts(server, request.prompt)
        truncate_prompts(server, prompts, request.truncate_prompt_tokens, texts=True)
        check_context(prompts, request.max_tokens, server.config.max_model_len, "prompt")
        # Echoed prompt tokens come with their own logprobs, as OpenAI's API gives them.
        prompt_logprobs = request.logprobs if echo_logprobs else None
        sampling = sampling_params(
            request, request.max_tokens, request.logprobs, prompt_logprobs, structured_outputs_of(request)
        )
        return cls(request, model, prompts, sampling)

    def engine_call(self, server: FrontendServer) -> EngineCall:
        return EngineCall(server, self.prompts, self.sampling, keep_n=self.request.n, model=self.model)

    def _prompt_of(self, server: FrontendServer, index: int) -> Prompt:
        prompt = self.prompts[index // self.request.n]
        if prompt.text is None:
            prompt.text = decoded(server, prompt.token_ids)
        return prompt

    def _logprobs(self, server: FrontendServer, call: EngineCall, index: int) -> CompletionLogprobs | None:
        if self.request.logprobs is None:
            return None
        choice = call.choices[index]
        if not self.request.echo:
            return completion_logprobs(server, choice.logprobs, [], 0)
        prompt = self._prompt_of(server, index)
        prompt_positions = call.prompt_logprobs[index // call.n] or [None] * len(prompt.token_ids)
        return completion_logprobs(server, [*prompt_positions, *choice.logprobs], prompt.token_ids, 0)

    async def response(self, server: FrontendServer, call: EngineCall) -> CompletionResponse:
        await call.wait()
        choices = []
        for i, c in enumerate(call.choices):
            text = (self._prompt_of(server, i).text if self.request.echo else "") + "".join(c.text)
            choices.append(
                CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=self._logprobs(server, call, i),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=call.usage()
        )

    async def chunks(self, server: FrontendServer, call: EngineCall) -> AsyncIterator[CompletionResponse]:
        options = self.request.stream_options
        started: set[int] = set()
        offsets = [0] * len(call.choices)  # characters of token text sent so far, per choice
        async for index, out in call.outputs():
            text = out.text
            if self.request.echo and index not in started:
                text = self._prompt_of(server, index).text + text
            started.add(index)
            if not text and out.finish_reason is None and not out.logprobs:
                continue  # nothing to show yet (held back while a stop string may match)
            logprobs = None
            if self.request.logprobs is not None:
                logprobs = completion_logprobs(server, out.logprobs or [], [], offsets[index])
                offsets[index] += sum(len(t) for t in logprobs.tokens)
            choice = CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason
            )
            usage = call.usage() if options and options.continuous_usage_stats else None
            yield CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)
        if options and options.include_usage:
            yield CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=call.usage())


# ---- chat completions -----------------------------------------------------------------------------


@dataclass(slots=True)
class ToolMode:
    """How a chat request's tools are used: the parser that reads calls out of the output, and
    the tool_choice that picked it ("auto", "required" or "named")."""

    choice: str
    parser: ToolParser
    single: bool  # parallel_tool_calls: false

    def finish_reason(self, called: bool, reason: str | None) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call; a forced named call ends with "stop".
        return "tool_calls" if called and reason == "stop" and self.choice != "named" else reason


def tool_mode(server: FrontendServer, request: ChatCompletionRequest) -> ToolMode | None:
    """The request's tool mode as vLLM decides it (None: no tool calls are read)."""
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if request.tools else "none"
    if choice == "none":
        return None
    if not request.tools:
        raise BadRequestError("tool_choice: needs tools", "tool_choice")
    single = request.parallel_tool_calls is False
    if isinstance(choice, NamedToolChoice):
        return ToolMode("named", NamedParser(choice.function.name), single)
    if choice == "required":
        return ToolMode("required", RequiredParser(), single)
    config = server.config
    if not config.enable_auto_tool_choice or config.tool_call_parser is None:
        raise BadRequestError(
            'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice",
        )
    return ToolMode("auto", tool_parser(config.tool_call_parser), single)


def _response_tool_calls(calls) -> list[ResponseToolCall]:
    return [ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments)) for c in calls]


def _delta_tool_calls(deltas: list[CallDelta]) -> list[DeltaToolCall]:
    return [
        DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id else None,
            function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in deltas
    ]


@dataclass(slots=True)
class ChatCall:
    """One /v1/chat/completions request, validated and ready to run."""

    request: ChatCompletionRequest
    model: str
    prompt: Prompt
    sampling: SamplingParams
    tools: ToolMode | None = None
    reasoning_parser: str | None = None  # --reasoning-parser: split each choice's thinking from its answer
    id: str = field(default_factory=lambda: request_id("chatcmpl"))
    created: int = field(default_factory=now_s)

    @classmethod
    def build(cls, server: FrontendServer, request: ChatCompletionRequest, model: str) -> ChatCall:
        if request.top_logprobs is not None and not request.logprobs:
            raise BadRequestError("top_logprobs: needs logprobs: true", "top_logprobs")
        check_best_of(server, request)
        tools = tool_mode(server, request)
        prompt = conversation_prompt(server, request)
        truncate_prompts(server, [prompt], request.truncate_prompt_tokens, texts=False)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        check_context([prompt], max_tokens, server.config.max_model_len, "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        schema = tool_choice_schema(request.tools, request.tool_choice, not tools.single) if tools else None
        # A parser whose marker is a special token needs it in the text.
        keep_special = False if tools is not None and tools.parser.needs_special_tokens else None
        sampling = sampling_params(
            request, max_tokens, logprobs, None, structured_outputs_of(request, schema), keep_special
        )
        call = cls(request, model, prompt, sampling, tools, server.config.reasoning_parser)
        call._constrain_the_answer_only(server)
        return call

    def _constrain_the_answer_only(self, server: FrontendServer) -> None:
        """Under a reasoning parser, an output constraint (response_format, a forced tool call)
        applies to the answer: the engine's grammar sleeps until the end-of-thinking tokens."""
        parser, constraint = self._reasoning(), self.sampling.structured_outputs
        if parser is not None and constraint is not None and parser.thinks_first:
            constraint.starts_after = server.tokenizer.encode(parser.END, add_special_tokens=False)

    def _reasoning(self) -> ReasoningParser | None:
        """A fresh parser for one choice (None: no reasoning parser)."""
        return reasoning_parser(self.reasoning_parser, self.prompt.text or "") if self.reasoning_parser else None

    def engine_call(self, server: FrontendServer) -> EngineCall:
        return EngineCall(server, [self.prompt], self.sampling, keep_n=self.request.n, model=self.model)

    def _logprobs(self, server: FrontendServer, positions: SampleLogprobs | None) -> ChatLogprobs | None:
        if not self.request.logprobs:
            return None
        return chat_logprobs(server, positions or [], self.request.top_logprobs or 0)

    def _message(self, choice: _Choice) -> tuple[ChatResponseMessage, str | None]:
        text, reasoning = "".join(choice.text), None
        parser = self._reasoning()
        if parser is not None:  # tool calls and the answer are read from what follows the thinking
            split = parser.split(text, final=True)
            text, reasoning = split.content, split.reasoning if self.request.include_reasoning else None
        if self.tools is None:
            message = ChatResponseMessage(content=text if text or reasoning is None else None)
            return self._with_reasoning(message, reasoning), choice.finish_reason
        content, calls = self.tools.parser.extract(text)
        if self.tools.single:
            calls = calls[:1]
        message = ChatResponseMessage(content=content, tool_calls=_response_tool_calls(calls))
        return self._with_reasoning(message, reasoning), self.tools.finish_reason(bool(calls), choice.finish_reason)

    @staticmethod
    def _with_reasoning(message: ChatResponseMessage, reasoning: str | None) -> ChatResponseMessage:
        message.reasoning_content = message.reasoning = reasoning
        return message

    async def response(self, server: FrontendServer, call: EngineCall) -> ChatCompletionResponse:
        await call.wait()
        choices = []
        for i, c in enumerate(call.choices):
            message, finish_reason = self._message(c)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    logprobs=self._logprobs(server, c.logprobs),
                    finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=call.usage()
        )

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def _delta(
        self, thinking: ReasoningStream | None, stream: ToolCallStream | None, out: ServerOutput
    ) -> tuple[DeltaMessage, str | None]:
        """The delta to send for one engine output, and the choice's finish reason."""
        final = out.finish_reason is not None
        text, reasoning = out.text, ""
        if thinking is not None:
            reasoning, text = thinking.feed(out.text, final)
            reasoning = reasoning if self.request.include_reasoning else ""
        thought = dict(reasoning_content=reasoning, reasoning=reasoning) if reasoning else {}
        if stream is None:
            return DeltaMessage(content=text or None, **thought), out.finish_reason
        content, deltas = stream.feed(text, final=final)
        if self.tools.single:
            deltas = [d for d in deltas if d.index == 0]
        delta = DeltaMessage(content=content or None, tool_calls=_delta_tool_calls(deltas) or None, **thought)
        return delta, self.tools.finish_reason(stream.called, out.finish_reason)

    async def chunks(self, server: FrontendServer, call: EngineCall) -> AsyncIterator[ChatCompletionChunk]:
        options = self.request.stream_options
        streams = [ToolCallStream(self.tools.parser) if self.tools else None for _ in call.choices]
        thinking = [ReasoningStream(parser) if (parser := self._reasoning()) else None for _ in call.choices]
        # The role comes first, once per choice, as OpenAI sends it.
        for index in range(len(call.choices)):
            yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for index, out in call.outputs():
            delta, finish_reason = self._delta(thinking[index], streams[index], out)
            if delta == DeltaMessage() and finish_reason is None and not out.logprobs:
                continue  # nothing to show yet (held back while a stop string or a tool marker may match)
            choice = ChatStreamChoice(
                index=index,
                delta=delta,
                logprobs=self._logprobs(server, out.logprobs),
                finish_reason=finish_reason,
                stop_reason=out.stop_reason,
            )
            yield self._chunk([choice], call.usage() if options and options.continuous_usage_stats else None)
        if options and options.include_usage:
            yield self._chunk([], call.usage())
