"""Fixtures the GPU test modules share, and a clean device between tests."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from tests.helpers.gpu import PROMPT_LENGTHS, SHAPES
from tests.helpers.models import save_tiny_model

# A test that leaves more than this allocated (a failed engine test's KV cache, say) is cleaned up
# after; below it a full collection after each of the ~900 kernel tests would cost minutes.
_COLLECT_ABOVE_BYTES = 1 << 30


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    """After each test, what it left unreferenced is collected and the CUDA cache returned, so the
    next test starts with the device's memory free. A failed test's frames (its models, tensors)
    stay referenced from sys.last_traceback, where pytest leaves them: dropped first."""
    yield
    if not torch.cuda.is_available():
        return
    failed = False
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            failed = True
            delattr(sys, name)
    if failed or torch.cuda.memory_allocated() > _COLLECT_ABOVE_BYTES:
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CUDA generator, so each test draws the same random inputs every run."""
    generator = torch.Generator(device="cuda")
    generator.manual_seed(1234)
    return generator


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model_dir(request, tmp_path_factory) -> str:
    """A random model of each of helpers/gpu.py's SHAPES (a module may define its own model_dir)."""
    directory = tmp_path_factory.mktemp(request.param)
    settings = dict(SHAPES[request.param])
    save_tiny_model(
        directory,
        settings.pop("architecture", "llama"),
        vocab_size=256,
        max_position_embeddings=4096,
        initializer_range=0.2,
        **settings,
    )
    return str(directory)


@pytest.fixture(scope="module")
def prompt_ids() -> list[list[int]]:
    """Random prompts of helpers/gpu.py's PROMPT_LENGTHS (a module may define its own prompt_ids)."""
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENGTHS]
