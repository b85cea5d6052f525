"""Shared fixtures: the real SmolLM2 checkpoint, HF references, tiny random checkpoints."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# Tests run on the CPU with deterministic, single-process kernels.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from zllm.model_files import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from zllm.frontend.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_dir)


def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | list[int] | None, **generate_kwargs
) -> list[int]:
    """HF transformers' greedy continuation of one prompt (batch 1, no padding); extra arguments
    (logits processors, penalties, ...) go to `generate`."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids], device=model.device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            **generate_kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


TINY_ARCHITECTURES = {  # architecture: (transformers config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def save_tiny_model(directory: Path, architecture: str = "llama", shards: int = 1, **overrides) -> Path:
    """A small random model built with transformers' own classes, saved as safetensors beside a
    placeholder word-level tokenizer over its vocabulary (the engine's frontend needs one).

    Biases and norm weights are randomised too (HF starts them at 0 and 1), so a tensor loaded
    into the wrong place changes the output.
    """
    import torch
    import transformers

    from benchmarks.dummy_model import write_placeholder_tokenizer

    config_class, model_class = (getattr(transformers, name) for name in TINY_ARCHITECTURES[architecture])
    settings = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = model_class(config_class(**settings)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("gate.weight"):  # MoE routers: HF may start them at zero (every expert tied)
                param.copy_(torch.randn_like(param))
    max_shard = None if shards == 1 else f"{max(1, _param_bytes(model) // shards // 1024 + 1)}KB"
    kwargs = {} if max_shard is None else {"max_shard_size": max_shard}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    write_placeholder_tokenizer(directory, settings["vocab_size"])
    return directory


def save_tiny_llama(directory: Path, shards: int = 1, **overrides) -> Path:
    return save_tiny_model(directory, "llama", shards, **overrides)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def processes_gone(pids: list[int]) -> bool:
    """Every one of these processes has exited (a zombie counts as gone: it holds no memory)."""
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class ServerHandle:
    """A `vllm-launch` server running as a real process tree."""

    def __init__(self, process, endpoint: str, runtime_dir: str, log_path: Path) -> None:
        self.process = process
        self.endpoint = endpoint
        self.runtime_dir = runtime_dir
        self.log_path = log_path
        self.http_url = ""  # the OpenAI-compatible API's base URL, from the ready line

    def read_http_url(self) -> None:
        import re

        match = re.search(r"zllm ready: .* and (http://\S+) ", self.log())
        self.http_url = match.group(1) if match else ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_dir(self) -> Path:
        """The runtime subdirectory of the current engine (engine-1, then engine-2 after a restart...)."""
        return max(Path(self.runtime_dir).glob("engine-*"), key=lambda path: int(path.name.split("-")[1]))

    def children(self):
        import psutil

        return psutil.Process(self.process.pid).children(recursive=True)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the server drains); a server still there after `timeout` is killed, with its
        engine processes, and the test fails rather than leave them running."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            import psutil

            leftovers = self.children()
            self.process.kill()
            for child in leftovers:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            self.process.wait(30)
            raise


def start_server(
    directory: Path,
    model_dir: str,
    *extra: str,
    timeout: float = 180.0,
    endpoint: str | None = None,
    env: dict[str, str] | None = None,
) -> ServerHandle:
    """Start vllm-launch (with these environment variables added) and wait for its ready line."""
    import subprocess
    import sys
    import time

    runtime_dir = directory / "rt"
    endpoint = endpoint or f"ipc://{directory}/client.sock"
    log_path = directory / "server.log"
    command = [
        sys.executable,
        "-m",
        "zllm.launch.cli",
        "--model",
        model_dir,
        "--zmq-endpoint",
        endpoint,
        "--runtime-dir",
        str(runtime_dir),
        "--kv-cache-memory",
        "256MiB",
        "--max-model-len",
        "2048",
        "--port",
        "0",
        *extra,
    ]  # port 0: a free port, so servers started in parallel never clash
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None
        )
    handle = ServerHandle(process, endpoint, str(runtime_dir), log_path)
    deadline = time.monotonic() + timeout
    while "zllm ready" not in handle.log():
        if process.poll() is not None or time.monotonic() > deadline:
            handle.stop()
            raise RuntimeError(f"server did not start:\n{handle.log()[-3000:]}")
        time.sleep(0.2)
    handle.read_http_url()
    return handle


@pytest.fixture(scope="session")
def server(tmp_path_factory, smollm2_dir):
    handle = start_server(tmp_path_factory.mktemp("server"), smollm2_dir)
    yield handle
    handle.stop()
