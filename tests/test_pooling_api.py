"""The pooling routes of a real `vllm-launch` process serving the real all-MiniLM-L6-v2, through
the official `openai` client (float and base64), langchain's OpenAIEmbeddings, plain HTTP for
/score, /rerank (Cohere's shape) and the refusals, and the Python ZMQ client; every embedding is
compared with sentence-transformers' own."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.helpers.pooling import minilm_dir, mixed_sentences
from tests.helpers.server import ONE_THREAD, start_server

MODEL = "all-MiniLM-L6-v2"
SENTENCES = mixed_sentences(12)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    handle = start_server(
        tmp_path_factory.mktemp("pooling-api"),
        minilm_dir(),
        "--max-model-len",
        "256",
        "--served-model-name",
        MODEL,
        "--device",
        "cpu",
        env=ONE_THREAD,
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir(), device="cpu").encode(SENTENCES, convert_to_numpy=True)


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _close_to(vectors, reference: np.ndarray) -> bool:
    ours = np.asarray(vectors, dtype=np.float64)
    cosines = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    return ours.shape == reference.shape and cosines.min() >= 0.99999


def _vector(embedding: list[float] | str) -> list[float]:
    """A float list, or base64 of little-endian float32s (what the client returns when asked for it)."""
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4").tolist()
    return embedding


# NOTE: with no encoding_format the openai client asks for base64 itself and decodes it to floats;
# given explicitly, it returns the base64 string.
@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_openai_client_embeddings(client, reference, encoding_format):
    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    response = client.embeddings.create(model=MODEL, input=SENTENCES, **kwargs)
    assert [d.index for d in response.data] == list(range(len(SENTENCES)))
    assert isinstance(response.data[0].embedding, str) == (encoding_format == "base64")
    assert _close_to([_vector(d.embedding) for d in response.data], reference)
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(SENTENCES)
    one = client.embeddings.create(model=MODEL, input=SENTENCES[0], **kwargs)
    assert _close_to([_vector(one.data[0].embedding)], reference[:1])


def test_token_id_inputs_and_raw_base64(api, client, reference):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(minilm_dir()).encode(SENTENCES[1])
    by_ids = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float").data[0].embedding
    assert _close_to([by_ids], reference[1:2])
    raw = httpx.post(f"{api.http_url}/v1/embeddings", json={"input": SENTENCES[1], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, by_ids, atol=1e-7)


def test_langchain_openai_embeddings(api, reference):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=f"{api.http_url}/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # send the texts, not tiktoken's ids for OpenAI's models
        max_retries=0,
    )
    assert _close_to(embeddings.embed_documents(SENTENCES), reference)
    assert _close_to([embeddings.embed_query(SENTENCES[2])], reference[2:3])


def test_python_client_embeds(api, reference):
    from zllm import Client

    with Client(api.endpoint) as client:
        out = client.embed(SENTENCES[3])
    assert _close_to([out.outputs.embedding], reference[3:4]) and out.prompt_token_ids


def test_rerank_in_cohere_shape_and_score(api):
    query = "what is a fox"
    documents = ["cars are fast", "a fox is a small wild animal of the dog family", "bread is baked"]
    response = httpx.post(
        f"{api.http_url}/v2/rerank", json={"model": MODEL, "query": query, "documents": documents, "top_n": 2}
    )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["index"] for r in results][0] == 1 and len(results) == 2
    assert results[0]["relevance_score"] > results[1]["relevance_score"]
    assert results[0]["document"]["text"] == documents[1]
    score = httpx.post(f"{api.http_url}/score", json={"model": MODEL, "text_1": query, "text_2": documents}).json()
    by_index = {d["index"]: d["score"] for d in score["data"]}
    assert by_index[1] == pytest.approx(results[0]["relevance_score"], abs=1e-6)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/v1/embeddings", {"input": [1000] * 300}, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"input": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 4}, "task"),
        ("/v2/rerank", {"query": "q", "documents": []}, "documents"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/classify", {"input": "hello"}, "task"),
    ],
)
def test_bad_input_is_400_with_the_reason(api, path, body, param):
    response = httpx.post(f"{api.http_url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
