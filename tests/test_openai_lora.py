"""LoRA adapters over HTTP, with the official openai client against a served process: a request's
`model` names an adapter (its greedy text equals transformers + PEFT's), /v1/models lists the
adapters beside the base model, an unknown model is a 404 in OpenAI's shape, and adapters load
and unload at run time only when ZLLM_ALLOW_RUNTIME_LORA_UPDATING allows it."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.lora import MAX_NEW, PROMPTS, tiny_llama_with_adapters
from tests.helpers.server import ONE_THREAD, start_server
from zllm import Client, SamplingParams
from zllm.client import RequestError

TINY_SERVER = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "16MiB")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_with_adapters(tmp_path_factory.mktemp("lora-http"))


@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny):
    model_dir, adapters, _ = tiny
    handle = start_server(
        tmp_path_factory.mktemp("lora-server"),
        str(model_dir),
        *TINY_SERVER,
        "--enable-lora",
        "--lora-modules",
        f"all-r8={adapters / 'all-r8'}",
        f"qv-rslora={adapters / 'qv-rslora'}",
        "--max-loras",
        "2",
        env={**ONE_THREAD, "ZLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def completion_text(client: openai.OpenAI, model: str, prompt: list[int]) -> list[str]:
    """The completion's words (the placeholder tokenizer has one word per token id)."""
    response = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0)
    assert response.model == model
    return response.choices[0].text.split()


def expected_text(tiny, name: str, prompt_index: int) -> list[str]:
    from transformers import AutoTokenizer

    model_dir, _, references = tiny
    return AutoTokenizer.from_pretrained(model_dir).decode(references[name][prompt_index]).split()


def test_models_lists_the_adapters_beside_the_base(client, tiny):
    models = {m.id: m for m in client.models.list().data}
    base = next(name for name, m in models.items() if getattr(m, "parent", None) is None)
    assert set(models) == {base, "all-r8", "qv-rslora"}
    assert models["all-r8"].parent == base and models["all-r8"].root == str(tiny[1] / "all-r8")


def test_the_model_field_picks_the_adapter(client, tiny):
    base = client.models.list().data[0].id
    for name in (base, "all-r8", "qv-rslora"):
        reference = "base" if name == base else name
        assert completion_text(client, name, PROMPTS[1]) == expected_text(tiny, reference, 1), name
    stream = client.completions.create(
        model="qv-rslora", prompt=PROMPTS[2], max_tokens=MAX_NEW, temperature=0.0, stream=True
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {"qv-rslora"}
    assert "".join(c.choices[0].text for c in chunks if c.choices).split() == expected_text(tiny, "qv-rslora", 2)


def test_an_unknown_model_is_a_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=1)
    assert error.value.body["code"] == "model_not_found"
    assert "no-such-adapter" in error.value.body["message"]


def test_load_and_unload_at_run_time(api, client, tiny, tmp_path):
    _, adapters, _ = tiny
    url = api.http_url
    loaded = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters / "mlp-r16")}
    )
    assert loaded.status_code == 200, loaded.text
    assert "mlp" in {m.id for m in client.models.list().data}
    assert completion_text(client, "mlp", PROMPTS[2]) == expected_text(tiny, "mlp-r16", 2)
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp", "lora_path": str(adapters / "ko-r2")})
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    broken = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert broken.status_code == 400 and "adapter_config.json" in broken.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt=PROMPTS[2], max_tokens=1)
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    # The engine serves on: the other adapters are unchanged.
    assert completion_text(client, "all-r8", PROMPTS[0]) == expected_text(tiny, "all-r8", 0)


def test_runtime_updates_are_off_without_the_setting(tmp_path, tiny):
    model_dir, adapters, _ = tiny
    handle = start_server(tmp_path, str(model_dir), *TINY_SERVER, "--enable-lora", env=ONE_THREAD)
    try:
        response = httpx.post(
            f"{handle.http_url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters / "all-r8")}
        )
        assert response.status_code == 404
    finally:
        handle.stop()


def test_the_zmq_client_names_the_adapter_too(api, tiny):
    _, _, references = tiny
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with Client(api.endpoint) as client:
        out = client.generate(prompt_token_ids=PROMPTS[1], sampling_params=params, lora_name="qv-rslora")
        assert out.outputs[0].token_ids == references["qv-rslora"][1]
        with pytest.raises(RequestError, match="no LoRA adapter named 'nope'"):
            client.generate(prompt_token_ids=PROMPTS[1], sampling_params=params, lora_name="nope")
