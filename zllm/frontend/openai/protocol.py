"""The OpenAI-compatible HTTP API's request and response bodies, as msgspec Structs.

Requests are decoded tolerantly, as vLLM does: a field this server does not know is accepted and
ignored (clients and SDKs send fields a server may not use), logged once per name and listed in
the `X-Ignored-Fields` response header; a known field with a wrong type is a 400 that names it
(msgspec reports the JSON path). Field names are OpenAI's, plus vLLM's extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, structured_outputs, guided_*, ...),
with vLLM's meanings. Responses have OpenAI's shapes; `openapi_document` describes both.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

import msgspec


class _Request(msgspec.Struct, kw_only=True):
    pass


class _Response(msgspec.Struct, kw_only=True):
    pass


# ---- requests ---------------------------------------------------------------------------------


class JsonSchemaFormat(_Request, kw_only=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None  # None: any JSON object
    strict: bool | None = None  # accepted; the grammar always enforces the schema


class ResponseFormat(_Request, kw_only=True):
    """OpenAI's response_format: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request, kw_only=True):
    """vLLM's structured_outputs object: exactly one constraint."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Request, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class _SamplingRequest(_Request, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None  # generate this many, return the n with the highest cumulative logprob
    response_format: ResponseFormat | None = None
    # Accepted and ignored: OpenAI's end-user id, request tags and processing tier.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    # vLLM's older names for structured_outputs' fields
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingRequest, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None  # this many top alternatives per token (plus the sampled one)
    suffix: str | None = None  # not supported: refused unless null


class TextContent(_Request, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageContent(_Request, kw_only=True, tag_field="type", tag="image_url"):
    """An image by URL (`{"url": "data:...;base64,..." | "https://..." | "file://..."}`), for a
    vision-language model (zllm/frontend/openai/media.py loads it); a text model refuses it."""

    image_url: dict[str, Any]


class FunctionCall(_Request, kw_only=True):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class ToolCallMessage(_Request, kw_only=True):
    """A call an earlier assistant turn made (in the request's messages)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request, kw_only=True):
    role: str
    content: str | list[TextContent | ImageContent] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # role "assistant"
    tool_call_id: str | None = None  # role "tool": the call this message answers


class FunctionDefinition(_Request, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatTool(_Request, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request, kw_only=True):
    name: str


class NamedToolChoice(_Request, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call
    # vLLM's extensions. (A per-request chat_template is not accepted: it would run any Jinja.)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (enable_thinking: false)
    include_reasoning: bool = True  # with --reasoning-parser: False drops the reasoning from the answer


# ---- responses --------------------------------------------------------------------------------


class UsageInfo(_Response, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it


class CompletionResponse(_Response, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Response, kw_only=True):
    content: list[ChatTokenLogprob] | None = None


class ResponseFunctionCall(_Response, kw_only=True):
    name: str
    arguments: str


class ResponseToolCall(_Response, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(_Response, kw_only=True):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] = []
    # With --reasoning-parser: the thinking, under vLLM's older and newer names.
    reasoning_content: str | None = None
    reasoning: str | None = None


class DeltaFunctionCall(_Response, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response, kw_only=True, omit_defaults=True):
    """A streamed piece of a tool call: id, type and name in the first piece, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoice(_Response, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(_Response, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None  # as in ChatResponseMessage
    reasoning: str | None = None


class ChatStreamChoice(_Response, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "zllm"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (None: a base model)
    max_model_len: int


class LoadLoRAAdapterRequest(_Request, kw_only=True):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request, kw_only=True):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and unused)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(_Response, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionInfo(_Response, kw_only=True):
    version: str


class TokenizeCompletionRequest(_Request, kw_only=True):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_Request, kw_only=True):
    model: str | None = None
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the chat template already holds them


class TokenizeResponse(_Response, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request, kw_only=True):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response, kw_only=True):
    prompt: str


class ErrorInfo(_Response, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response, kw_only=True):
    error: ErrorInfo


# ---- decoding ---------------------------------------------------------------------------------


class BadRequestError(ValueError):
    """A request the API refuses with 400; `param` names the offending field when known."""

    status = 400  # a subclass may name something that does not exist (404)

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


_PARAM_IN_PATH = re.compile(r"at `\$\.(\w+)")
_PARAM_UNKNOWN = re.compile(r"unknown field `(\w+)`")
_PARAM_LEADING = re.compile(r"^(\w+): ")


def decode_request(body: bytes, type_: type[_Request]) -> tuple[Any, list[str]]:
    """Decode a JSON body: the request, and the fields it has that `type_` does not know (as
    `messages[0].foo` paths), which are ignored. A wrong type or value is a BadRequestError naming the
    field."""
    try:
        request = msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as error:
        raise BadRequestError(f"invalid request: {error}", param_of(str(error))) from None
    except msgspec.DecodeError as error:
        raise BadRequestError(f"the body is not valid JSON: {error}") from None
    return request, unknown_fields(msgspec.json.decode(body), msgspec.inspect.type_info(type_))


def unknown_fields(value: Any, info: msgspec.inspect.Type, path: str = "") -> list[str]:
    """Paths of the object keys in `value` (already known to decode as `info`) that no Struct
    field takes."""
    if isinstance(info, msgspec.inspect.UnionType):
        return next((unknown_fields(value, t, path) for t in info.types if _matches(value, t)), [])
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        known = set(fields) | ({info.tag_field} if info.tag_field else set())
        found = [f"{path}{key}" for key in value if key not in known]
        for key, field_type in fields.items():
            if key in value:
                found += unknown_fields(value[key], field_type, f"{path}{key}.")
        return found
    if isinstance(info, msgspec.inspect.ListType) and isinstance(value, list):
        return [p for i, item in enumerate(value) for p in unknown_fields(item, info.item_type, f"{path[:-1]}[{i}].")]
    return []


def _matches(value: Any, info: msgspec.inspect.Type) -> bool:
    """Whether this union member is the one `value` decoded as (Structs in our unions are told
    apart by their tag or by being the only object type)."""
    if isinstance(info, msgspec.inspect.StructType):
        return isinstance(value, dict) and (info.tag_field is None or value.get(info.tag_field) == info.tag)
    if isinstance(info, msgspec.inspect.ListType):
        return isinstance(value, list)
    return False


def param_of(message: str) -> str | None:
    """The field an error message is about: msgspec's `$.field` path or our `field: ...` prefix."""
    for pattern in (_PARAM_IN_PATH, _PARAM_UNKNOWN, _PARAM_LEADING):
        match = pattern.search(message)
        if match:
            return match.group(1)
    return None


def now_s() -> int:
    return int(time.time())


# ---- the OpenAPI document -----------------------------------------------------------------------

_REF = "#/components/schemas/{name}"


def _json(schema_name: str) -> dict:
    return {"application/json": {"schema": {"$ref": _REF.format(name=schema_name)}}}


def _errors(*codes: int, shape: str = "ErrorResponse") -> dict:
    reasons = {
        400: "Bad request",
        401: "Missing or wrong API key",
        404: "Unknown model (or stored response)",
        413: "Body too large",
        503: "Engine dead or draining",
    }
    return {str(code): {"description": reasons[code], "content": _json(shape)} for code in codes}


# A typed server-sent event (the Responses and Messages APIs): `event: <type>` and `data: <json>`.
_NAMED_EVENT = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
}


def _generation(
    summary: str, request: str, response: str, error_shape: str = "ErrorResponse", named: bool = False
) -> dict:
    ok = {
        "description": "The answer; with `stream: true`, server-sent events "
        + ("named by their type" if named else "ending with `data: [DONE]`"),
        "content": {**_json(response), "text/event-stream": {"schema": _NAMED_EVENT if named else {"type": "string"}}},
        "headers": _IGNORED_HEADER,
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {"200": ok, **_errors(400, 401, 404, 413, 503, shape=error_shape)},
            "security": [{"bearer": []}],
        }
    }


def _utility(summary: str, request_schema: dict, response: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}},
            "responses": {"200": {"description": "OK", "content": _json(response)}, **_errors(400, 404, 413)},
        }
    }


_IGNORED_HEADER = {
    "X-Ignored-Fields": {
        "description": "The request's fields this server does not know and ignored, comma-separated "
        "(as JSON paths: `foo`, `messages[0].bar`); absent when none",
        "schema": {"type": "string"},
    }
}


def openapi_document(version: str) -> dict:
    """OpenAPI 3.1 for every route, with schemas generated from the Structs above (and the
    Responses and Messages APIs' own, imported here: their modules import this one)."""
    from zllm.frontend.openai.messages_protocol import ErrorBody, Message, MessagesRequest
    from zllm.frontend.openai.responses_protocol import ResponseObject, ResponsesRequest

    types = [
        ResponsesRequest,
        ResponseObject,
        MessagesRequest,
        Message,
        ErrorBody,
        CompletionRequest,
        ChatCompletionRequest,
        CompletionResponse,
        ChatCompletionResponse,
        ChatCompletionChunk,
        ModelList,
        VersionInfo,
        ErrorResponse,
        TokenizeCompletionRequest,
        TokenizeChatRequest,
        TokenizeResponse,
        DetokenizeRequest,
        DetokenizeResponse,
    ]
    _, schemas = msgspec.json.schema_components(types, ref_template=_REF)
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "zllm OpenAI-compatible API", "version": version},
        "paths": {
            "/v1/completions": _generation("Complete prompts", "CompletionRequest", "CompletionResponse"),
            "/v1/chat/completions": _generation(
                "Answer a conversation", "ChatCompletionRequest", "ChatCompletionResponse"
            ),
            "/v1/responses": _generation(
                "Respond (OpenAI's Responses API)", "ResponsesRequest", "ResponseObject", named=True
            ),
            "/v1/responses/{response_id}": {
                "get": {
                    "summary": "A stored response (--enable-responses-store)",
                    "parameters": [
                        {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "security": [{"bearer": []}],
                    "responses": {
                        "200": {"description": "The response", "content": _json("ResponseObject")},
                        **_errors(401, 404),
                    },
                }
            },
            "/v1/messages": _generation(
                "Answer messages (Anthropic's Messages API)", "MessagesRequest", "Message", "ErrorBody", named=True
            ),
            "/tokenize": _utility(
                "Token ids of a prompt, or of chat messages rendered by the chat template",
                {
                    "oneOf": [
                        {"$ref": _REF.format(name="TokenizeCompletionRequest")},
                        {"$ref": _REF.format(name="TokenizeChatRequest")},
                    ]
                },
                "TokenizeResponse",
            ),
            "/detokenize": _utility(
                "The text of token ids", {"$ref": _REF.format(name="DetokenizeRequest")}, "DetokenizeResponse"
            ),
            "/v1/models": {
                "get": {
                    "summary": "The served model",
                    "security": [{"bearer": []}],
                    "responses": {"200": {"description": "Models", "content": _json("ModelList")}, **_errors(401)},
                }
            },
            "/health": {
                "get": {
                    "summary": "200 while serving",
                    "responses": {"200": {"description": "Serving"}, **_errors(503)},
                }
            },
            "/version": {
                "get": {
                    "summary": "zllm's version",
                    "responses": {"200": {"description": "Version", "content": _json("VersionInfo")}},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "Metrics in Prometheus' text format", "content": text}},
                }
            },
        },
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
