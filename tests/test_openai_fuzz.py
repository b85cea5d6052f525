"""Schema fuzzing: schemathesis drives the server's own OpenAPI document against a real
`vllm-launch` process and every answer must conform to it — never a 5xx, always a documented
status, content type and body shape, and schema-invalid input always refused with a 4xx.

The server runs a tiny random Llama with SmolLM2's tokenizer and chat template (same vocabulary,
so prompts and token ids mean the same), a 64-token context and n up to 4 (--max-n), so a
fuzzed request that generates costs milliseconds; the examples per route are few and bounded
in time.
"""

from __future__ import annotations

import shutil

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers.models import save_tiny_llama

# NOTE: on a small shared CPU, torch's spinning intra-op threads slow each other down many times
from tests.helpers.server import start_server

# NOTE: on a small shared CPU, torch's spinning intra-op threads slow each other down many times
# over (a 2-thread matmul measured 20x slower than 1 thread under load); one thread keeps the
# tests' engine steps fast. Outputs are compared within one server, so the setting cannot matter.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
API_KEY = "fuzz-key"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, smollm2_dir):
    model = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    save_tiny_llama(
        model, vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=64
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{smollm2_dir}/{name}", model / name)
    handle = start_server(
        tmp_path_factory.mktemp("fuzz"),
        str(model),
        "--api-key",
        API_KEY,
        "--max-model-len",
        "64",
        "--num-kv-blocks",
        "64",
        "--max-request-body",
        "256KiB",
        "--max-n",
        "4",
        "--max-num-seqs",
        "32",
        env=ONE_THREAD,
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.http_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_answers_match_the_schema(case, fuzz_server):
    case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS, timeout=30)


def test_anthropic_clients_authenticate_with_x_api_key(fuzz_server):
    """Anthropic's clients send their key as `x-api-key`; a wrong one is a 401 in Anthropic's shape."""
    import httpx

    body = {"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    url = f"{fuzz_server.http_url}/v1/messages"
    model = httpx.get(f"{fuzz_server.http_url}/v1/models", headers={"x-api-key": API_KEY}, timeout=30)
    assert model.status_code == 401  # x-api-key is Anthropic's, taken on /v1/messages only
    body["model"] = httpx.get(
        f"{fuzz_server.http_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    ).json()["data"][0]["id"]
    assert httpx.post(url, json=body, headers={"x-api-key": API_KEY}, timeout=60).status_code == 200
    wrong = httpx.post(url, json=body, headers={"x-api-key": "nope"}, timeout=60)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
