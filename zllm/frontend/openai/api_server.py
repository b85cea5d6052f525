"""The OpenAI-compatible HTTP API, served by the frontend process on its own asyncio loop.

    POST /v1/completions        POST /v1/chat/completions        GET /v1/models
    POST /v1/responses          GET  /v1/responses/{id}          (responses.py: OpenAI's Responses API)
    POST /v1/messages           (messages_api.py: Anthropic's Messages API, with Anthropic's error shape)
    POST /tokenize              POST /detokenize
    POST /v1/embeddings  /score  /rerank  /classify   (pooling models: pooling.py)
    POST /v1/load_lora_adapter  /v1/unload_lora_adapter   (lora_routes.py, when allowed)
    GET  /health                GET  /version                    GET /metrics     GET /openapi.json

Built on aiohttp: its AppRunner runs inside an event loop someone else owns (the frontend's, which
also serves the ZMQ endpoint and talks to the engine core) and leaves signal handling to
`vllm-launch`; it can cancel a handler the moment its client disconnects (so the request is
aborted in the engine, streaming or not); it enforces a body size limit itself (413). Bodies are
decoded with msgspec, the project's one serialization library, with the field named in every
error (unknown fields are ignored, below). Requests reach the engine through the
FrontendServer's in-process client path (see serving.py).

Every error has OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 for bad
parameters, 401 for a missing or wrong API key on /v1 routes, 404 for an unknown model or route,
413 for an oversized body, 503 when the engine is dead or the server is draining (and, on /health
only, while the engine restarts after a failure).

Request fields the server does not know are ignored, as vLLM does; each name is logged once (at
warning level) and a response that ignored any lists them in its `X-Ignored-Fields` header.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

import zllm
from zllm.frontend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from zllm.frontend.openai.lora_routes import LoRARoutes
from zllm.frontend.openai.messages_api import MessagesCall, error_type
from zllm.frontend.openai.messages_protocol import ErrorBody, ErrorDetail, MessagesRequest
from zllm.frontend.openai.pooling import PoolingRoutes
from zllm.frontend.openai.protocol import (
    BadRequestError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionInfo,
    decode_request,
    now_s,
    openapi_document,
    param_of,
)
from zllm.frontend.openai.responses import ResponsesCall, ResponseStore
from zllm.frontend.openai.responses_protocol import ResponsesRequest
from zllm.frontend.openai.serving import (
    NO_TOKENIZER,
    ChatCall,
    CompletionCall,
    FrontendRequestError,
    attach_images,
    conversation_prompt,
)
from zllm.ipc.messages import ClientStats, ServerStats

if TYPE_CHECKING:
    from zllm.frontend.server import FrontendServer

logger = logging.getLogger("zllm.frontend.api")

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_IGNORED_HEADER_MAX_CHARS = 1024  # clients refuse long headers (aiohttp's limit is 8190 bytes)
_MAX_WARNED_FIELDS = 1024  # distinct names logged; bounded so that fuzzed names cannot grow it forever
_warned_fields: set[str] = set()  # unknown field names already logged (once each)
ANTHROPIC_PREFIX = "/v1/messages"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# ServerError kinds -> HTTP status (retry-later conditions are 503, as OpenAI answers "overloaded").
_ENGINE_ERROR_STATUS = {"bad_request": 400, "unauthorized": 401, "engine_dead": 503, "overloaded": 503, "draining": 503}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return msgspec.json.encode(ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)))


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> web.Response:
    return web.Response(status=status, body=error_body(message, type_, param, code), content_type="application/json")


def anthropic_error_response(status: int, message: str) -> web.Response:
    body = msgspec.json.encode(ErrorBody(error=ErrorDetail(type=error_type(status), message=message)))
    return web.Response(status=status, body=body, content_type="application/json")


def _api_error_response(
    request: web.Request, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> web.Response:
    """The error in the shape of the API the route belongs to: Anthropic's for /v1/messages."""
    if request.path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_response(status, message)
    return error_response(status, message, type_, param, code)


def json_response(value: msgspec.Struct, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), content_type="application/json", headers=headers)


def _from_engine_error(error: FrontendRequestError) -> ApiError:
    status = _ENGINE_ERROR_STATUS.get(error.kind, 500)
    if status == 400:
        return ApiError(400, str(error), "invalid_request_error", _request_field(str(error)))
    if status == 401:
        return ApiError(401, str(error), "authentication_error", code="invalid_api_key")
    return ApiError(status, str(error), "server_error", code=error.kind)


def _request_field(message: str) -> str | None:
    # The engine names its own fields (prompt_token_ids); the API's field is `prompt`.
    param = param_of(message)
    return "prompt" if param == "prompt_token_ids" else param


class ApiServer:
    def __init__(self, frontend: FrontendServer) -> None:
        self.frontend = frontend
        self.config = frontend.config
        self._runner: web.AppRunner | None = None
        self._openapi = msgspec.json.encode(openapi_document(zllm.__version__))
        self.responses = ResponseStore() if self.config.enable_responses_store else None
        self.lora = LoRARoutes(self)

    # ---- lifecycle -----------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_request_body_bytes, middlewares=[self._errors, self._authenticate]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/responses", self.create_response)
        app.router.add_get("/v1/responses/{response_id}", self.get_response)
        app.router.add_post("/v1/messages", self.create_message)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        PoolingRoutes(self).register(app)  # /v1/embeddings, /score, /rerank, /classify
        self.lora.register(app)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        return app

    async def start(self) -> str:
        """Listen on config.host:config.port; returns the base URL (with the real port for port 0)."""
        self._runner = web.AppRunner(self.build_app(), handle_signals=False, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        # Several API servers share host:port: the kernel spreads new connections over them.
        shared = self.config.api_server_count > 1
        sock = socket.create_server((self.config.host, self.config.port), backlog=1024, reuse_port=shared)
        await web.SockSite(self._runner, sock).start()
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        logger.info("OpenAI-compatible API on %s%s", url, " (API key required)" if self.config.api_key else "")
        return url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- middlewares ---------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every failure becomes an OpenAI-shaped error; bad input never becomes a 500."""
        try:
            return await handler(request)
        except BadRequestError as error:
            return _api_error_response(
                request, error.status, str(error), "invalid_request_error", error.param, error.code
            )
        except FrontendRequestError as error:
            error = _from_engine_error(error)
            return _api_error_response(request, error.status, str(error), error.type, error.param, error.code)
        except ApiError as error:
            return _api_error_response(request, error.status, str(error), error.type, error.param, error.code)
        except web.HTTPException as error:  # routing (404, 405) and the body limit (413)
            if error.status < 400:
                raise
            return _api_error_response(
                request,
                error.status,
                _http_error_message(request, error),
                "invalid_request_error",
                code=error.reason.lower().replace(" ", "_"),
            )
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away; nothing to answer
        except Exception:
            logger.exception("internal error on %s %s", request.method, request.path)
            return _api_error_response(request, 500, "internal server error", "server_error")

    @web.middleware
    async def _authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        key = self.config.api_key
        if key and (request.path == "/v1" or request.path.startswith("/v1/")):
            given = request.headers.get("Authorization", "")
            if request.path.startswith(ANTHROPIC_PREFIX) and "x-api-key" in request.headers:
                given = f"Bearer {request.headers['x-api-key']}"  # Anthropic's clients send their key so
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise ApiError(
                    401,
                    "missing or wrong API key: send `Authorization: Bearer <key>`",
                    "authentication_error",
                    code="invalid_api_key",
                )
        return await handler(request)

    # ---- generation ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, ignored = await self._decode(request, CompletionRequest)
        call = CompletionCall.build(self.frontend, body, self._model(body.model))
        return await self._run(request, call, body.stream, ignored)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, ignored = await self._decode(request, ChatCompletionRequest)
        call = ChatCall.build(self.frontend, body, self._model(body.model))
        await attach_images(self.frontend, call.prompt)
        return await self._run(request, call, body.stream, ignored)

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        body, ignored = await self._decode(request, ResponsesRequest)
        call = ResponsesCall.build(self.frontend, body, self._model(body.model), self.responses)
        return await self._run(request, call, body.stream, ignored)

    async def create_message(self, request: web.Request) -> web.StreamResponse:
        body, ignored = await self._decode(request, MessagesRequest)
        call = MessagesCall.build(self.frontend, body, self._model(body.model))
        return await self._run(request, call, body.stream, ignored)

    async def get_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        stored = self.responses.get(response_id) if self.responses is not None else None
        if stored is None:
            raise ApiError(404, f"no stored response {response_id!r}", "invalid_request_error", code="not_found")
        return json_response(stored.response)

    async def _decode(self, request: web.Request, type_: type) -> tuple[msgspec.Struct, dict[str, str]]:
        """The request body, and the header listing the fields it had that are ignored."""
        body, ignored = decode_request(await request.read(), type_)
        for name in ignored:
            if name not in _warned_fields and len(_warned_fields) < _MAX_WARNED_FIELDS:
                _warned_fields.add(name)
                logger.warning("ignoring the unknown request field %r on %s (logged once)", name, request.path)
        return body, {IGNORED_FIELDS_HEADER: ignored_fields_header(ignored)} if ignored else {}

    async def _run(self, request: web.Request, call, stream: bool, headers: dict[str, str]) -> web.StreamResponse:
        """Run a call (CompletionCall, ChatCall, ResponsesCall, MessagesCall: `engine_call`,
        `response`, `chunks`; those whose events are named also have `error_event`)."""
        self._check_serving()
        async with call.engine_call(self.frontend) as engine:
            if not stream:
                return json_response(await call.response(self.frontend, engine), headers)
            return await self._stream(request, call, call.chunks(self.frontend, engine), headers)

    async def _stream(
        self, request: web.Request, call, chunks: AsyncIterator[msgspec.Struct], headers: dict[str, str]
    ) -> web.StreamResponse:
        """Server-sent events: `data: <json>` per chunk, then `data: [DONE]` (OpenAI's completions);
        or `event: <type>` + `data: <json>` per typed event, without [DONE] (the Responses and
        Anthropic Messages APIs)."""
        named = getattr(call, "named_events", False)
        response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        await response.prepare(request)
        try:
            async for chunk in chunks:
                await response.write(_sse_event(chunk, named))
        except FrontendRequestError as error:  # the status line is gone: report it in the stream
            error = _from_engine_error(error)
            if named:
                await response.write(_sse_event(call.error_event(str(error), error.code, error.param), named))
            else:
                body = error_body(str(error), error.type, error.param, error.code)
                await response.write(b"data: " + body + b"\n\n")
        if not named:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _model(self, requested: str | None) -> str:
        """The served name a request asked for: the base model's (also when it names none) or a
        LoRA adapter's; 404 for any other."""
        served = self.config.model_name
        if requested is not None and requested != served and not self.lora.serves(requested):
            raise ApiError(
                404,
                f"The model `{requested}` does not exist (this server serves `{served}`).",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return requested or served

    def _check_tokenizer(self, field: str) -> None:
        if self.frontend.tokenizer is None:
            raise BadRequestError(NO_TOKENIZER.format(field=field), field)

    def _check_serving(self) -> None:
        if self.frontend.dead_reason is not None:
            raise ApiError(503, f"engine is dead: {self.frontend.dead_reason}", "server_error", code="engine_dead")
        if self.frontend.draining:
            raise ApiError(503, "the server is shutting down", "server_error", code="draining")

    # ---- information ---------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(
            id=self.config.model_name, created=now_s(), root=self.config.model, max_model_len=self.config.max_model_len
        )
        return json_response(ModelList(data=[card, *self.lora.cards()]))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a prompt (with the tokenizer's special tokens by default) or chat
        messages (through the chat template, as /v1/chat/completions renders them)."""
        self._check_tokenizer("prompt")
        chat = _has_messages(await request.read())
        body, headers = await self._decode(request, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        self._model(body.model)
        text = conversation_prompt(self.frontend, body).text if chat else body.prompt
        tokens = self.frontend.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return json_response(
            TokenizeResponse(count=len(tokens), max_model_len=self.config.max_model_len, tokens=tokens), headers
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body, headers = await self._decode(request, DetokenizeRequest)
        self._model(body.model)
        self._check_tokenizer("tokens")
        vocab_size = len(self.frontend.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise BadRequestError(f"tokens: ids must be in [0, {vocab_size}), got {bad[:5]}", "tokens")
        return json_response(DetokenizeResponse(prompt=self.frontend.tokenizer.decode(body.tokens)), headers)

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving; 503 (with the reason) when dead, draining, or restarting the engine
        after a failure (requests sent meanwhile are held and served once it is back)."""
        self._check_serving()
        if self.frontend.recovering:
            raise ApiError(
                503, "the engine is restarting after a failure; retry shortly", "server_error", code="engine_restarting"
            )
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return json_response(VersionInfo(version=zllm.__version__))

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        self.frontend.metrics.update_engine_stats(await self.engine_stats())
        return web.Response(body=self.frontend.metrics.export(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def engine_stats(self, timeout_s: float = 5.0) -> dict | None:
        """The engine core's stats (the `stats` utility call), or None if it cannot answer."""
        if self.frontend.dead_reason is not None:
            return None
        identity, inbox = self.frontend.open_local_client()
        try:
            await self.frontend.submit(identity, ClientStats(call_id=0))
            reply = await asyncio.wait_for(inbox.get(), timeout_s)
            return reply.stats if isinstance(reply, ServerStats) else None
        except asyncio.TimeoutError:
            return None
        finally:
            await self.frontend.close_local_client(identity)


def _sse_event(chunk: msgspec.Struct, named: bool) -> bytes:
    data = b"data: " + msgspec.json.encode(chunk) + b"\n\n"
    return f"event: {chunk.type}\n".encode() + data if named else data


def ignored_fields_header(paths: list[str]) -> str:
    """The paths, comma-separated, as printable ASCII (JSON escapes: a header may hold nothing
    else) and cut to a length every client accepts, saying how many more there were."""
    text = ""
    for i, path in enumerate(paths):
        item = json.dumps(path)[1:-1]
        if len(text) + len(item) + 2 > _IGNORED_HEADER_MAX_CHARS:
            return f"{text}, ... ({len(paths) - i} more)"
        text = f"{text}, {item}" if text else item
    return text


def _has_messages(raw: bytes) -> bool:
    """A /tokenize body of chat messages (else a prompt). The schema offers one or the other
    (oneOf): a body with both is refused rather than read as one of them."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return False  # decode_request reports it
    if isinstance(value, dict) and "messages" in value and "prompt" in value:
        raise BadRequestError("prompt: give either prompt or messages, not both", "prompt")
    return isinstance(value, dict) and "messages" in value


def _http_error_message(request: web.Request, error: web.HTTPException) -> str:
    if isinstance(error, web.HTTPRequestEntityTooLarge):
        return f"request body too large: {error.text}"
    if isinstance(error, web.HTTPNotFound):
        return f"no route {request.method} {request.path}"
    if isinstance(error, web.HTTPMethodNotAllowed):
        return f"method {request.method} not allowed on {request.path}"
    return error.text or error.reason
