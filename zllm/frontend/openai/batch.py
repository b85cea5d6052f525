"""OpenAI batch files, run by the frontend process over its own server (`vllm-launch run-batch`).

    input line   {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    output line  {"id": "batch_req_...", "custom_id": "r1",
                  "response": {"status_code": 200, "request_id": "...", "body": <the API's answer>},
                  "error": null}
    failed line  the same, with status_code 4xx/5xx, the API's error object as the body and
                 "error": {"code": ..., "message": ...}; a line that is not even a request
                 (bad JSON, no url) gets one too, so every input line has exactly one output line.

Each line runs exactly as the HTTP route of its `url` would run it (the same request Structs,
`*Call.build`, engine calls and answers), dispatched through `ENDPOINTS`; all lines run
concurrently (up to a bound) so that the engine batches them, and the results are written in
input order. A new kind of line (embeddings, once pooling models are served) is one entry there.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from zllm.frontend.openai.protocol import (
    BadRequestError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    decode_request,
)
from zllm.frontend.openai.responses import ResponsesCall
from zllm.frontend.openai.responses_protocol import ResponsesRequest
from zllm.frontend.openai.serving import ChatCall, CompletionCall, FrontendRequestError

if TYPE_CHECKING:
    from zllm.frontend.server import FrontendServer

# ServerError kinds -> the HTTP status the API would have answered with.
_ENGINE_STATUS = {"bad_request": 400, "engine_dead": 503, "overloaded": 503, "draining": 503}


class LineError(Exception):
    """A line that fails: its HTTP status, and the OpenAI error it answers with."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param = status, type_, param


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A URL a batch line may name: how its body decodes and how it is built into a call."""

    request_type: type | None  # None: known but not served by this model
    build: Callable[[FrontendServer, Any, str], Any] | None = None
    refusal: str = ""


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, ChatCall.build),
    "/v1/completions": Endpoint(CompletionRequest, CompletionCall.build),
    # No previous_response_id: a batch keeps no responses.
    "/v1/responses": Endpoint(
        ResponsesRequest, lambda server, request, model: ResponsesCall.build(server, request, model, None)
    ),
    # Pooling models (embeddings) plug in here once the engine serves them.
    "/v1/embeddings": Endpoint(None, refusal="this model does not serve embeddings (/v1/embeddings)"),
}


class BatchLine(msgspec.Struct, kw_only=True):
    custom_id: str
    method: str = "POST"
    url: str
    body: dict[str, Any]


class BatchResponse(msgspec.Struct, kw_only=True):
    status_code: int
    request_id: str
    body: Any


class BatchError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class BatchOutput(msgspec.Struct, kw_only=True):
    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None = None


def _parse(raw: str, number: int) -> tuple[BatchLine | None, str | None, LineError | None]:
    """The line as a request, its custom_id as far as it can be read, or why it is not one."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as error:
        return None, None, LineError(400, f"line {number}: not JSON: {error}")
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) else None
    try:
        line = msgspec.convert(value, BatchLine)
    except msgspec.ValidationError as error:
        return None, custom_id, LineError(400, f"line {number}: not a batch request: {error}")
    if line.method != "POST":
        return (
            None,
            custom_id,
            LineError(400, f"line {number}: method must be POST, got {line.method!r}", param="method"),
        )
    return line, custom_id, None


def check_model(served: str, requested: str | None) -> None:
    if requested is not None and requested != served:
        raise LineError(404, f"The model `{requested}` does not exist (this server serves `{served}`).", param="model")


async def _answer(server: FrontendServer, line: BatchLine) -> msgspec.Struct:
    endpoint = ENDPOINTS.get(line.url)
    if endpoint is None:
        raise LineError(400, f"url: must be one of {sorted(ENDPOINTS)}, got {line.url!r}", param="url")
    if endpoint.request_type is None:
        raise LineError(400, endpoint.refusal, param="url")
    request, _ = decode_request(msgspec.json.encode(line.body), endpoint.request_type)
    if request.stream:
        raise LineError(400, "stream: batch requests cannot be streamed", param="stream")
    check_model(server.config.model_name, request.model)
    call = endpoint.build(server, request, server.config.model_name)
    async with call.engine_call(server) as engine:
        return await call.response(server, engine)


async def run_line(server: FrontendServer, raw: str, number: int) -> BatchOutput:
    """One input line's output line; never raises for bad input or a failed request."""
    request_id = f"batch_req_{secrets.token_hex(12)}"
    line, custom_id, error = _parse(raw, number)
    if error is None:
        try:
            body = await _answer(server, line)
            return BatchOutput(
                id=request_id,
                custom_id=custom_id,
                response=BatchResponse(status_code=200, request_id=request_id, body=body),
            )
        except BadRequestError as failure:
            error = LineError(failure.status, str(failure), param=failure.param)
        except FrontendRequestError as failure:
            error = LineError(_ENGINE_STATUS.get(failure.kind, 500), str(failure), "server_error")
        except LineError as failure:
            error = failure
    body = ErrorResponse(error=ErrorInfo(message=str(error), type=error.type, param=error.param))
    return BatchOutput(
        id=request_id,
        custom_id=custom_id,
        response=BatchResponse(status_code=error.status, request_id=request_id, body=body),
        error=BatchError(code=error.type, message=str(error)),
    )


async def run_batch(
    server: FrontendServer, lines: Iterable[str], on_done: Callable[[], None], max_concurrency: int = 256
) -> list[bytes]:
    """Every non-blank line's output line (JSON, in input order); `on_done` after each."""
    limit = asyncio.Semaphore(max_concurrency)

    async def one(raw: str, number: int) -> bytes:
        async with limit:
            output = await run_line(server, raw, number)
        on_done()
        return msgspec.json.encode(output)

    numbered = [(raw, number) for number, raw in enumerate(lines, 1) if raw.strip()]
    return await asyncio.gather(*(one(raw, number) for raw, number in numbered))
