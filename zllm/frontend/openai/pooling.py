"""The pooling routes of the HTTP API: embeddings, scores, reranking and classification.

    POST /v1/embeddings                  OpenAI's shape (a string, strings, token ids; float or base64)
    POST /score    /v1/score             vLLM's (text_1 against text_2, one or many)
    POST /rerank   /v1/rerank /v2/rerank  Jina's and Cohere's (a query, documents, top_n)
    POST /classify /v1/classify          vLLM's (class probabilities per input)

Each call is one in-process client of the FrontendServer, as a completion is (serving.py): every
input becomes a ClientGenerate carrying PoolingParams, answered by one ServerOutput whose
`pooled` is the finished vector (normalized, truncated or turned into probabilities by the
frontend's output processor). A cross-encoder scores a pair as one input; an embedding model
scores the cosine of the two embeddings.
"""

from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from zllm.frontend.openai.protocol import BadRequestError, now_s
from zllm.frontend.openai.serving import FrontendRequestError, kept_tokens, request_id
from zllm.ipc.messages import ClientGenerate, ServerError, ServerOutput
from zllm.pooling import cosine

if TYPE_CHECKING:
    from zllm.frontend.openai.api_server import ApiServer


class _Struct(msgspec.Struct, kw_only=True):
    pass


# ---- bodies ----------------------------------------------------------------------------------------


class EmbeddingRequest(_Struct):
    input: Any  # a string, a list of strings, a list of token ids, or a list of such lists
    model: str | None = None
    encoding_format: str = "float"  # "float" or "base64" (float32, little-endian)
    dimensions: int | None = None  # Matryoshka models only
    normalize: bool | None = None  # vLLM's extension; None: as the model declares
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last k tokens; -1: max_model_len


class ScoreRequest(_Struct):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last k tokens; -1: max_model_len


class RerankRequest(_Struct):
    query: str
    documents: list[Any]  # strings, or Cohere's {"text": ...} objects
    model: str | None = None
    top_n: int | None = None  # the best n; None or 0: all
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last k tokens; -1: max_model_len


class ClassificationRequest(_Struct):
    input: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: each input's last k tokens; -1: max_model_len


class PoolingUsage(_Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(_Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingResponse(_Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
    object: str = "list"


class ScoreData(_Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(_Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankDocument(_Struct):
    text: str


class RerankResult(_Struct):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(_Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: PoolingUsage


class ClassificationData(_Struct):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int
    object: str = "classification"


class ClassificationResponse(_Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
    object: str = "list"


# ---- routes ----------------------------------------------------------------------------------------


class PoolingRoutes:
    """The pooling handlers of one ApiServer."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api
        self.frontend = api.frontend
        self.pooler = api.config.pooler

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, self.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self.rerank)
        for path in ("/classify", "/v1/classify"):
            app.router.add_post(path, self.classify)

    async def embeddings(self, request: web.Request) -> web.Response:
        body, headers = await self.api._decode(request, EmbeddingRequest)
        model = self.api._model(body.model)
        if body.encoding_format not in ("float", "base64"):
            raise BadRequestError("encoding_format: must be 'float' or 'base64'", "encoding_format")
        pooling = {"task": "embed", "dimensions": body.dimensions, "normalize": body.normalize}
        pooling["truncate_prompt_tokens"] = self._truncation(body.truncate_prompt_tokens)
        outputs = await self._pool([_input(item) for item in _inputs(body.input)], pooling)
        data = [EmbeddingData(i, _encoded(o.pooled, body.encoding_format)) for i, o in enumerate(outputs)]
        return _json(EmbeddingResponse(request_id("embd"), now_s(), model, data, _usage(outputs)), headers)

    async def score(self, request: web.Request) -> web.Response:
        body, headers = await self.api._decode(request, ScoreRequest)
        model = self.api._model(body.model)
        firsts, seconds = _pairs(body.text_1, body.text_2)
        scores, outputs = await self._scores(firsts, seconds, self._truncation(body.truncate_prompt_tokens))
        data = [ScoreData(i, s) for i, s in enumerate(scores)]
        return _json(ScoreResponse(request_id("score"), now_s(), model, data, _usage(outputs)), headers)

    async def rerank(self, request: web.Request) -> web.Response:
        body, headers = await self.api._decode(request, RerankRequest)
        model = self.api._model(body.model)
        documents = [_document_text(d, i) for i, d in enumerate(body.documents)]
        if not documents:
            raise BadRequestError("documents: must not be empty", "documents")
        if body.top_n is not None and body.top_n < 0:
            raise BadRequestError("top_n: must be >= 0", "top_n")
        truncation = self._truncation(body.truncate_prompt_tokens)
        scores, outputs = await self._scores([body.query] * len(documents), documents, truncation)
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[: body.top_n or None]
        results = [
            RerankResult(i, scores[i], RerankDocument(documents[i]) if body.return_documents else None) for i in ranked
        ]
        return _json(RerankResponse(request_id("rerank"), model, results, _usage(outputs)), headers)

    async def classify(self, request: web.Request) -> web.Response:
        body, headers = await self.api._decode(request, ClassificationRequest)
        model = self.api._model(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        pooling = {"task": "classify", "truncate_prompt_tokens": self._truncation(body.truncate_prompt_tokens)}
        outputs = await self._pool([{"prompt": _text(t, "input")} for t in _non_empty(texts, "input")], pooling)
        labels = self.pooler.labels if self.pooler is not None else []
        data = [ClassificationData(i, _label(o.pooled, labels), o.pooled, len(o.pooled)) for i, o in enumerate(outputs)]
        return _json(ClassificationResponse(request_id("classify"), now_s(), model, data, _usage(outputs)), headers)

    # ---- through the frontend server ---------------------------------------------------------------

    def _truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """The body's truncate_prompt_tokens, checked here (a 400 naming it) before any input runs."""
        kept_tokens(truncate_prompt_tokens, self.api.config.max_model_len)
        return truncate_prompt_tokens

    async def _scores(
        self, firsts: list[str], seconds: list[str], truncation: int | None = None
    ) -> tuple[list[float], list[ServerOutput]]:
        """A cross-encoder's pair scores (truncation: of each pair's joined tokens), or the cosines
        of the texts' embeddings (each text truncated)."""
        if self.pooler is not None and self.pooler.kind == "classify":
            pairs = [{"prompt": _text(a, "text_1"), "prompt_pair": _text(b, "text_2")} for a, b in zip(firsts, seconds)]
            outputs = await self._pool(pairs, {"task": "score", "truncate_prompt_tokens": truncation})
            return [o.pooled[0] for o in outputs], outputs
        texts = [{"prompt": _text(t, "text")} for t in [*firsts, *seconds]]
        outputs = await self._pool(texts, {"task": "embed", "truncate_prompt_tokens": truncation})
        half = len(firsts)
        return [cosine(a.pooled, b.pooled) for a, b in zip(outputs[:half], outputs[half:])], outputs

    async def _pool(self, inputs: list[dict[str, Any]], pooling: dict[str, Any]) -> list[ServerOutput]:
        """Every input through the frontend server as one local client; their outputs in order."""
        self.api._check_serving()
        pooling = {k: v for k, v in pooling.items() if v is not None}
        if "truncate_prompt_tokens" not in pooling:  # truncation re-reads a long input's text
            inputs = self._tokenized_together(inputs)
        identity, inbox = self.frontend.open_local_client()
        try:
            for index, fields in enumerate(inputs):
                await self.frontend.submit(identity, ClientGenerate(str(index), pooling=pooling, **fields))
            outputs: dict[str, ServerOutput] = {}
            while len(outputs) < len(inputs):
                message = await inbox.get()
                if isinstance(message, ServerError):
                    raise FrontendRequestError(message.message, message.kind)
                if isinstance(message, ServerOutput) and message.finished:
                    outputs[message.request_id] = message
            return [outputs[str(index)] for index in range(len(inputs))]
        finally:
            await self.frontend.close_local_client(identity)

    def _tokenized_together(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Single texts tokenized in one batch call (the tokenizer's parallel path), sent as ids."""
        texts = [fields["prompt"] for fields in inputs if set(fields) == {"prompt"}]
        if len(texts) < 2:
            return inputs
        ids = iter(self.frontend.tokenizer(texts)["input_ids"])
        return [{"prompt_token_ids": next(ids)} if set(f) == {"prompt"} else f for f in inputs]


# ---- helpers ---------------------------------------------------------------------------------------


def _json(value: msgspec.Struct, headers: dict[str, str]) -> web.Response:
    return web.Response(body=msgspec.json.encode(value), content_type="application/json", headers=headers)


def _inputs(value: Any) -> list[Any]:
    """OpenAI's `input`: a string, a list of token ids, or a list of either."""
    if isinstance(value, str) or (isinstance(value, list) and value and _is_int(value[0])):
        return [value]
    if not isinstance(value, list):
        raise BadRequestError("input: must be a string, a list of strings or a list of token ids", "input")
    return _non_empty(value, "input")


def _input(item: Any) -> dict[str, Any]:
    if isinstance(item, str):
        return {"prompt": _text(item, "input")}
    if isinstance(item, list) and item and all(_is_int(t) for t in item):
        return {"prompt_token_ids": item}
    raise BadRequestError("input: each item must be a non-empty string or a non-empty list of token ids", "input")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _non_empty(items: list, field: str) -> list:
    if not items:
        raise BadRequestError(f"{field}: must not be empty", field)
    return items


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequestError(f"{field}: must be a non-empty string", field)
    return value


def _pairs(text_1: str | list[str], text_2: str | list[str]) -> tuple[list[str], list[str]]:
    firsts = [text_1] if isinstance(text_1, str) else _non_empty(text_1, "text_1")
    seconds = [text_2] if isinstance(text_2, str) else _non_empty(text_2, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise BadRequestError(
            f"text_1: {len(firsts)} texts for {len(seconds)} in text_2; give one, or as many", "text_1"
        )
    return firsts, seconds


def _document_text(document: Any, index: int) -> str:
    text = document.get("text") if isinstance(document, dict) else document
    return _text(text, f"documents[{index}]")


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def _usage(outputs: list[ServerOutput]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids or ()) for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _label(probs: list[float], labels: list[str]) -> str | None:
    best = max(range(len(probs)), key=probs.__getitem__)
    return labels[best] if best < len(labels) else f"LABEL_{best}"
