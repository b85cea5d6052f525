"""Shared fixtures: the real SmolLM2 checkpoint, its HF model and tokenizer, a server over it.
The helpers test modules import are in tests/helpers/."""

from __future__ import annotations

import os

import pytest

from tests.helpers.server import start_server

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
        # The marker, not `"gpu" in item.keywords`: keywords hold every parent directory's name
        # too, so a checkout in a directory named gpu would skip every test.
        if item.get_closest_marker("gpu") is not None and not has_cuda:
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


@pytest.fixture(scope="session")
def server(tmp_path_factory, smollm2_dir):
    handle = start_server(tmp_path_factory.mktemp("server"), smollm2_dir)
    yield handle
    handle.stop()
