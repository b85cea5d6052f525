"""Fixtures the GPU test modules share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CUDA generator, so each test draws the same random inputs every run."""
    generator = torch.Generator(device="cuda")
    generator.manual_seed(1234)
    return generator
