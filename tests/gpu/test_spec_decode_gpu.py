"""EAGLE and EAGLE-3 speculation on a GPU: a tiny Llama made by transformers (the gqa-d64 shape,
8 layers) with random heads in their published layouts (tests/test_spec_decode_eagle.py).

- fp32 greedy output with each head equals decoding without speculation, token for token, with
  the engine's CUDA defaults (decode and piecewise graphs; with EAGLE-3 only the piecewise ones,
  which keep its aux layers).
- The workers' drafts on CUDA equal the transformers-module reference head's (fp32)."""

from __future__ import annotations

import pytest

from tests.helpers.gpu import SHAPES, engine_tokens
from tests.helpers.models import save_tiny_llama
from tests.test_spec_decode_eagle import check_drafts_against_reference, save_eagle_head

pytestmark = pytest.mark.gpu

SHAPE = {**SHAPES["gqa-d64"], "num_hidden_layers": 8, "vocab_size": 256}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    import json

    directory = save_tiny_llama(tmp_path_factory.mktemp("target"), **{**SHAPE, "max_position_embeddings": 2048})
    return directory, json.loads((directory / "config.json").read_text())


def _prompts() -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 17, 40, 77, 130, 9)]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_fp32_greedy_with_a_head_equals_decoding_without_speculation(target, tmp_path, method):
    directory, config = target
    head = save_eagle_head(tmp_path / "head", method, config, draft_vocab_size=128, head_dim=64)
    prompts = _prompts()
    expected = engine_tokens(directory, prompts, dtype="float32")
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    assert engine_tokens(directory, prompts, dtype="float32", speculative_config=spec) == expected


@pytest.mark.parametrize("pieces", [False, True], ids=["eager", "piecewise-graphs"])
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_drafts_on_cuda_equal_the_reference_head(tmp_path, method, pieces):
    """pieces: the target's steps replay the piecewise CUDA graphs (EAGLE-3's aux layers copied
    into the graphs' static buffer)."""
    check_drafts_against_reference(tmp_path, method, "cuda", shape=SHAPES["gqa-d64"], head_dim=64, pieces=pieces)
