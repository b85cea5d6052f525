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


def test_the_rejection_sampler_on_cuda_equals_cpu_for_greedy_rows_and_keeps_sampled_drafts(device="cuda"):
    """Greedy requests: the same tokens, counts and per-row tokens on CUDA as on the CPU (the grid
    of slots, the int32 cumulative product). Sampled requests: whatever they draw, the tokens
    before the last are their drafts, and -1 follows."""
    import torch

    from zllm.workers.sampler import SamplingMetadata
    from zllm.workers.spec_decode.rejection_sampler import DraftLayout, verify

    generator = torch.Generator().manual_seed(0)
    for num_requests in (1, 5, 12):  # 12: past the few-requests list build
        lengths = torch.randint(0, 5, (num_requests,), generator=generator).tolist()
        logits = torch.randn(sum(lengths) + num_requests, 64, generator=generator)
        argmax = logits.argmax(-1).tolist()
        drafts, row = [], 0
        for n in lengths:  # the argmax up to a random miss
            miss = int(torch.randint(0, n + 1, (), generator=generator))
            drafts.append([argmax[row + j] if j < miss else (argmax[row + j] + 1) % 64 for j in range(n)])
            row += n + 1
        layout = DraftLayout.of(drafts)
        zeros = torch.zeros(layout.num_rows)
        cpu = verify(logits, SamplingMetadata(temperature=zeros, all_greedy=True), layout)
        on_device = verify(logits.to(device), SamplingMetadata(temperature=zeros.to(device), all_greedy=True), layout)
        assert on_device.tokens.tolist() == cpu.tokens.tolist()
        assert on_device.num_tokens.tolist() == cpu.num_tokens.tolist()
        assert on_device.row_tokens().tolist() == cpu.row_tokens().tolist() == argmax
        assert cpu.num_tokens.tolist() == [
            1 + next((j for j, d in enumerate(ds) if d != argmax[first + j]), len(ds))
            for ds, first in zip(drafts, layout.first_row)
        ]
        ones = torch.ones(layout.num_rows, device=device)
        out = verify(logits.to(device), SamplingMetadata(temperature=ones, all_greedy=False), layout)
        for tokens, count, request_drafts in zip(out.tokens.tolist(), out.num_tokens.tolist(), drafts):
            assert 1 <= count <= len(request_drafts) + 1 and tokens[: count - 1] == request_drafts[: count - 1]
            assert all(t == -1 for t in tokens[count:]) and tokens[count - 1] >= 0


def test_spec_verify_cost_profile_sees_the_kernels_of_the_decode_graph(tmp_path):
    """benchmarks/spec_verify_cost.py --profile on CUDA: both step kinds replay the decode graph,
    and the profile still names its attention and GEMV kernels."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    model = save_tiny_llama(tmp_path / "tiny", **SHAPE)
    command = [sys.executable, "benchmarks/spec_verify_cost.py", "--model", str(model), "--max-model-len", "256"]
    command += ["--k", "4", "--iters", "5", "--profile", "--profile-steps", "3"]
    root = Path(__file__).resolve().parents[2]
    # The script imports zllm from this tree, and keeps the rest of the path (pyzmq, msgspec).
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    profiles = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"profile"')]
    assert [p["profile"] for p in profiles] == ["plain", "verify"]
    for profile in profiles:
        categories = profile["categories_ms"]
        assert categories["attention"] > 0 and categories["linear"] > 0 and categories["sampling"] > 0
        assert abs(sum(categories.values()) - profile["device_busy_ms"]) < 0.01
        assert profile["phases_ms"]["forward"] > 0
