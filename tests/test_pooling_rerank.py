"""A cross-encoder served at tp 2 by a real `vllm-launch`: /rerank in Cohere's and Jina's shape,
/score, /classify and the Python ZMQ client, each against transformers' scores of the pairs."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers.pooling import save_tiny_encoder
from tests.helpers.server import ONE_THREAD, start_server
from zllm import Client
from zllm.client import RequestError

QUERY = "what is a fox"
DOCUMENTS = [
    "cars are fast",
    "a fox is a small wild animal of the dog family",
    "bread is baked in an oven",
    "foxes hunt at night",
]
ATOL = 2e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_encoder(tmp_path_factory.mktemp("ce"), "BertForSequenceClassification", num_labels=1)


@pytest.fixture(scope="module")
def api(tmp_path_factory, model_dir):
    handle = start_server(
        tmp_path_factory.mktemp("rerank-api"),
        str(model_dir),
        "--max-model-len",
        "256",
        "--device",
        "cpu",
        "--tp",
        "2",
        env=ONE_THREAD,
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def reference(model_dir) -> list[float]:
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.sigmoid(model(**tokenizer(QUERY, d, return_tensors="pt")).logits)[0, 0].item() for d in DOCUMENTS]


def test_rerank_in_cohere_shape(api, reference):
    documents = [{"text": d} for d in DOCUMENTS]  # Cohere's objects; Jina's plain strings below
    response = httpx.post(
        f"{api.http_url}/v2/rerank",
        json={"query": QUERY, "documents": documents, "top_n": 3, "return_documents": False},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    expected = sorted(range(len(DOCUMENTS)), key=lambda i: -reference[i])[:3]
    assert [r["index"] for r in results] == expected
    assert all(abs(r["relevance_score"] - reference[r["index"]]) < ATOL for r in results)
    assert all(r.get("document") is None for r in results)
    jina = httpx.post(f"{api.http_url}/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=120).json()
    assert {r["index"]: r["document"]["text"] for r in jina["results"]} == dict(enumerate(DOCUMENTS))
    assert jina["usage"]["total_tokens"] > 0


def test_score_and_classify(api, reference):
    score = httpx.post(f"{api.http_url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=120).json()
    assert [d["index"] for d in score["data"]] == list(range(len(DOCUMENTS)))
    assert all(abs(d["score"] - reference[d["index"]]) < ATOL for d in score["data"])
    classes = httpx.post(f"{api.http_url}/classify", json={"input": ["a fox"]}, timeout=120).json()["data"]
    assert classes[0]["num_classes"] == 1 and classes[0]["label"] == "LABEL_0"


def test_python_client_scores_and_refusals(api, reference):
    with Client(api.endpoint) as client:
        got = client.score(QUERY, DOCUMENTS[1]).outputs.score
        assert abs(got - reference[1]) < ATOL
        with pytest.raises(RequestError, match="task: 'embed' is not served"):
            client.embed("a fox")
        with pytest.raises(RequestError, match="task: this is a pooling model"):
            client.generate("a fox")
    response = httpx.post(f"{api.http_url}/v1/embeddings", json={"input": "a fox"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "task"
