"""Checkpoints without a tokenizer: refused alike for every architecture unless
`skip_tokenizer_init` (`--skip-tokenizer-init`), which takes token ids in and gives token ids out
(the same tokens as HF transformers' greedy), and refuses what needs text with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import hf_greedy, save_tiny_model
from zllm import LLM, SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = [5, 9, 13, 21, 34]


def _without_tokenizer(directory: Path, architecture: str) -> Path:
    save_tiny_model(directory, architecture)
    for name in TOKENIZER_FILES:
        (directory / name).unlink(missing_ok=True)
    return directory


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gemma2"])
def test_a_checkpoint_without_a_tokenizer_is_refused_alike(tmp_path, architecture):
    model_dir = _without_tokenizer(tmp_path / architecture, architecture)
    with pytest.raises(ValueError, match="^tokenizer: .* has no tokenizer .*--skip-tokenizer-init"):
        LLM(str(model_dir), dtype="float32")


def test_skip_tokenizer_init_takes_and_gives_token_ids(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = _without_tokenizer(tmp_path / "m", "qwen3")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf_greedy(hf, PROMPT, 6, eos_token_id=None)
    with LLM(str(model_dir), dtype="float32", skip_tokenizer_init=True) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
        (output,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        completion = output.outputs[0]
        assert list(completion.token_ids) == expected
        assert completion.text == "" and len(completion.logprobs) == 6
        assert all(lp.decoded_token is None for position in completion.logprobs for lp in position.values())

        for prompt, params, field in [
            ("text", SamplingParams(max_tokens=2), "prompt"),
            ({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, stop=["x"]), "stop"),
            ({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, bad_words=["x"]), "bad_words"),
        ]:
            with pytest.raises(ValueError, match=f"^{field}: .*skip_tokenizer_init"):
                llm.generate([prompt], params, use_tqdm=False)
        with pytest.raises(ValueError, match="^messages: .*without a tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_the_cli_flag_reaches_the_config():
    from zllm.launch.args import engine_kwargs
    from zllm.launch.cli import build_parser

    assert engine_kwargs(build_parser().parse_args(["--skip-tokenizer-init"]))["skip_tokenizer_init"] is True
    assert engine_kwargs(build_parser().parse_args([]))["skip_tokenizer_init"] is False


def test_a_server_without_a_tokenizer_serves_token_ids_and_refuses_text(tmp_path):
    import httpx

    from tests.helpers.server import ONE_THREAD, start_server

    model_dir = _without_tokenizer(tmp_path / "m", "llama")
    (tmp_path / "s").mkdir()
    handle = start_server(
        tmp_path / "s", str(model_dir), "--skip-tokenizer-init", "--max-model-len", "256", env=ONE_THREAD
    )
    try:
        url = handle.http_url
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4 and answer.json()["choices"][0]["text"] == ""
        refused = [
            ("/v1/completions", {"prompt": "text", "max_tokens": 2}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
            ("/v1/responses", {"input": "hi"}, "messages"),
            ("/tokenize", {"prompt": "hi"}, "prompt"),
            ("/detokenize", {"tokens": [1, 2]}, "tokens"),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stop": ["x"]}, "stop"),
        ]
        for path, request, param in refused:
            response = httpx.post(f"{url}{path}", json=request, timeout=60)
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["param"] == param and "tokenizer" in response.json()["error"]["message"]
    finally:
        assert handle.stop() == 0
