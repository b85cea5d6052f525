"""`vllm-launch run-batch`: an OpenAI batch file of 50 mixed lines (chat completions, completions,
embeddings, and bad lines of every kind) through a real engine on the embedded SmolLM2, one
output line per input line, in order, each the API's answer or its error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.server import ONE_THREAD

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CITIES = ["Paris", "Berlin", "Rome", "Madrid", "Lisbon", "Vienna", "Prague", "Warsaw", "Dublin", "Oslo"]


def _chat(i: int, city: str) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me about {city}."}], "max_tokens": 8}
    return {
        "custom_id": f"chat-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**body, "temperature": 0},
    }


def _lines() -> tuple[list[str], dict[str, tuple[int, str]]]:
    """The input lines, and what each custom_id expects: (status, what the answer must show)."""
    lines, expected = [], {}
    for i in range(30):  # each city three times: equal requests, equal greedy answers
        lines.append(json.dumps(_chat(i, CITIES[i % 10])))
        expected[f"chat-{i}"] = (200, "chat.completion")
    for i in range(5):
        body = {"prompt": f"The capital of {CITIES[i]} is", "max_tokens": 4, "temperature": 0}
        lines.append(json.dumps({"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions", "body": body}))
        expected[f"cmpl-{i}"] = (200, "text_completion")
    body = {"input": "Tell me about Paris.", "max_output_tokens": 8, "temperature": 0}
    lines.append(json.dumps({"custom_id": "resp-0", "method": "POST", "url": "/v1/responses", "body": body}))
    expected["resp-0"] = (200, "response")
    for i in range(4):
        body = {"model": MODEL, "input": f"embed {i}"}
        lines.append(json.dumps({"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings", "body": body}))
        expected[f"emb-{i}"] = (400, "does not serve embeddings")
    bad = {
        "bad-max-tokens": ({**_chat(0, "Oslo")["body"], "max_tokens": -1}, "/v1/chat/completions", 400, "max_tokens"),
        "bad-model": ({**_chat(0, "Oslo")["body"], "model": "gpt-9"}, "/v1/chat/completions", 404, "gpt-9"),
        "bad-stream": ({**_chat(0, "Oslo")["body"], "stream": True}, "/v1/chat/completions", 400, "stream"),
        "bad-messages": ({"messages": "hello"}, "/v1/chat/completions", 400, "messages"),
        "bad-url": (_chat(0, "Oslo")["body"], "/v1/images", 400, "url"),
        "bad-context": (
            {**_chat(0, "Oslo")["body"], "max_tokens": 99999},
            "/v1/chat/completions",
            400,
            "context length",
        ),
    }
    for custom_id, (body, url, status, shows) in bad.items():
        lines.append(json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}))
        expected[custom_id] = (status, shows)
    lines.append('{"custom_id": "not-json", ')
    expected[None] = (400, "not JSON")
    lines.append(json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"}))
    expected["no-body"] = (400, "body")
    lines.append(json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/chat/completions", "body": {}}))
    expected["get"] = (400, "POST")
    lines.append(json.dumps({"custom_id": 7, "url": "/v1/completions", "body": {}}))
    expected[None] = (400, "not a batch request")
    assert len(lines) == 50
    return lines, expected


def test_run_batch_answers_every_line_in_order(tmp_path, smollm2_dir):
    lines, expected = _lines()
    source, target = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines[:25]) + "\n\n" + "\n".join(lines[25:]) + "\n")  # a blank line is skipped
    command = [sys.executable, "-m", "zllm.launch.cli", "run-batch", "-i", str(source), "-o", str(target)]
    command += ["--model", smollm2_dir, "--max-model-len", "2048", "--kv-cache-memory", "256MiB"]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**__import__("os").environ, **ONE_THREAD}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "50/50" in done.stderr  # the progress bar reached the end

    results = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(results) == 50
    ids = [r["custom_id"] for r in results]
    assert ids[:-4] == [k for k in expected if k is not None][:46] and ids[-4:] == [None, "no-body", "get", None]
    for n, result in enumerate(results):
        key = result["custom_id"]
        status, shows = expected[key] if key is not None else (400, "not JSON" if n == 46 else "not a batch request")
        response = result["response"]
        assert response["status_code"] == status, (key, result)
        assert result["id"].startswith("batch_req_") and response["request_id"] == result["id"]
        if status == 200:
            assert result["error"] is None and response["body"]["object"] == shows
            usage = response["body"]["usage"]
            assert usage.get("completion_tokens", usage.get("output_tokens")) <= 8
        else:
            assert shows in result["error"]["message"], (key, result)
            assert response["body"]["error"]["message"] == result["error"]["message"]

    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in results[:30]}
    for i in range(10):  # the same request three times: the same greedy answer
        assert answers[f"chat-{i}"] == answers[f"chat-{i + 10}"] == answers[f"chat-{i + 20}"] != ""
    assert len({answers[f"chat-{i}"] for i in range(10)}) > 1  # and different cities differ
    (paris,) = [r["response"]["body"] for r in results if r["custom_id"] == "resp-0"]
    assert paris["output"][0]["content"][0]["text"] == answers["chat-0"]  # the same chat underneath


def test_run_batch_refuses_a_missing_input_file(tmp_path):
    command = [
        sys.executable,
        "-m",
        "zllm.launch.cli",
        "run-batch",
        "-i",
        str(tmp_path / "none"),
        "-o",
        str(tmp_path / "o"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "none" in done.stderr
