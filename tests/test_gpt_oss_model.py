"""GPT-OSS against HF transformers (fp32, CPU), on tiny random checkpoints made by transformers
itself: attention sinks, a sliding window on alternating layers (window-aware KV blocks), YaRN,
q/k/v/o biases, MoE with a biased router and the clamped SwiGLU, and experts stored in MXFP4 as
OpenAI ships them (tests/helpers/models.py write_mxfp4_experts; transformers' own mxfp4 reader
loads the same file as the reference).

Greedy tokens equal HF generate's exactly, at tp 1 with chunked prefill and preemption from a
small cache, and at tp 2 (two worker processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.engine import count_row_steps
from tests.helpers.models import (
    greedy_engine_tokens,
    hf_greedy,
    save_tiny_model,
    scale_gpt_oss_gate_up,
    write_mxfp4_experts,
    write_mxfp4_reference,
)

MAX_TOKENS = 12
WINDOW = 8
PROMPTS = [[7, 3, 9, 11, 5], list(range(3, 40)), [7] * 5 + list(range(100, 130)), list(range(200, 213))]
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    max_position_embeddings=128,
    # Positions past original_max_position_embeddings (32) reach YaRN's interpolated frequencies.
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
    swiglu_limit=1.0,  # small enough that the tiny model's activations reach the clamp
    initializer_range=0.2,
)


def _save(tmp_path: Path, mxfp4: bool) -> Path:
    model_dir = save_tiny_model(tmp_path / ("mxfp4" if mxfp4 else "dense"), "gpt_oss", **CONFIG)
    _scale_sinks(model_dir)
    return write_mxfp4_experts(model_dir) if mxfp4 else model_dir


def _scale_sinks(model_dir: Path) -> None:
    """Sink logits of a few units, comparable to the tiny model's scores, so they move the softmax."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(2)
    for name in [n for n in tensors if n.endswith("self_attn.sinks")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=generator) * 2.0
    save_file(tensors, path, metadata={"format": "pt"})


def _hf_tokens(model_dir: Path, prompts: list[list[int]], **config_changes) -> list[list[int]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in config_changes.items():
        setattr(config, key, value)
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, config=config, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    return [hf_greedy(hf, p, MAX_TOKENS, eos_token_id=None) for p in prompts]


def _engine_tokens(model_dir: Path, prompts: list[list[int]], **engine_args):
    return greedy_engine_tokens(model_dir, prompts, MAX_TOKENS, **engine_args)


@pytest.mark.parametrize("mxfp4", [False, True], ids=["dense", "mxfp4"])
def test_matches_hf_with_chunked_prefill_and_preemption(tmp_path, mxfp4):
    """16-token steps chunk the long prompts across the window; a small cache preempts."""
    model_dir = _save(tmp_path, mxfp4)
    expected = _hf_tokens(model_dir, PROMPTS)
    tokens, llm = _engine_tokens(model_dir, PROMPTS, block_size=8, max_num_batched_tokens=16, num_kv_blocks=9)
    assert tokens == expected
    assert llm.engine.core.stats().num_preemptions > 0


@pytest.mark.parametrize("mxfp4", [False, True], ids=["dense", "mxfp4"])
def test_prompt_tokens_as_decode_rows_match_hf(tmp_path, monkeypatch, mxfp4):
    """mixed_graph_max_tokens: each 16-token step's prompt tokens go in as decode rows through the
    sinks' decode attention, the sliding layers' windows counted from each row's own position."""
    model_dir = _save(tmp_path, mxfp4)
    rows = count_row_steps(monkeypatch)
    tokens, _ = _engine_tokens(model_dir, PROMPTS, block_size=8, max_num_batched_tokens=16, mixed_graph_max_tokens=16)
    assert tokens == _hf_tokens(model_dir, PROMPTS)
    assert any(rows)


# gpt-oss-20b's and -120b's config.json (transformers 4.55's form: rope_scaling beside rope_theta;
# no swiglu_alpha, which transformers 5.17 does not write either).
GPT_OSS_20B_ROPE = {
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "rope_theta": 150000,
    "max_position_embeddings": 131072,
    "initial_context_length": 4096,
    "swiglu_limit": 7.0,
}


def test_released_config_form_matches_hf(tmp_path):
    """A tiny checkpoint whose config.json carries gpt-oss-20b's rotary and SwiGLU settings in its
    released form (GPT_OSS_20B_ROPE; the default swiglu_alpha), MXFP4 experts whose gate_up is
    scaled x4 so that the real limit of 7 clamps. YaRN matters: the default rotary at the same
    theta gives other tokens."""
    import json

    model_dir = save_tiny_model(tmp_path / "released", "gpt_oss", **{**CONFIG, "swiglu_limit": 7.0})
    _scale_sinks(model_dir)
    write_mxfp4_experts(scale_gpt_oss_gate_up(model_dir, 4.0))
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("rope_parameters", "swiglu_alpha"):
        config.pop(key, None)
    (model_dir / "config.json").write_text(json.dumps({**config, **GPT_OSS_20B_ROPE}, indent=2))
    expected = _hf_tokens(model_dir, PROMPTS)
    tokens, _ = _engine_tokens(model_dir, PROMPTS, max_model_len=256)
    assert tokens == expected
    assert expected != _hf_tokens(model_dir, PROMPTS, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


def test_plain_mxfp4_reference_is_what_transformers_reads(tmp_path):
    """The GPU tests' reference (write_mxfp4_reference: the kept MXFP4 values stored plain, which
    every transformers version reads alike) gives the same logits as transformers' own MXFP4
    reader on this machine."""
    from transformers import AutoModelForCausalLM

    dense = save_tiny_model(tmp_path / "dense", "gpt_oss", **CONFIG)
    _scale_sinks(dense)
    reference = write_mxfp4_reference(dense, tmp_path / "reference")
    mxfp4 = write_mxfp4_experts(dense)
    ids = torch.tensor([PROMPTS[2]])
    logits = []
    for model_dir in (reference, mxfp4):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
        with torch.no_grad():
            logits.append(hf.eval()(ids).logits)
    assert torch.equal(logits[0], logits[1])


def test_mxfp4_matches_hf_at_tp2(tmp_path):
    """Heads (and their sinks) and each expert's intermediate slice split over two ranks."""
    model_dir = _save(tmp_path, mxfp4=True)
    tokens, _ = _engine_tokens(model_dir, PROMPTS, tensor_parallel_size=2, kv_cache_memory_bytes=4 << 20)
    assert tokens == _hf_tokens(model_dir, PROMPTS)


def test_dummy_mxfp4_experts_are_the_same_model_at_tp1_and_tp2(tmp_path):
    """--load-format dummy fills MXFP4's stored tensors (random codes, small exponents) the same on
    every rank, as every other dummy tensor: tp 2 gives tp 1's tokens (the benchmarks' gpt-oss
    shape relies on it)."""
    model_dir = _save(tmp_path, mxfp4=True)
    tp1, _ = _engine_tokens(model_dir, PROMPTS[:2], load_format="dummy")
    tp2, _ = _engine_tokens(model_dir, PROMPTS[:2], load_format="dummy", tensor_parallel_size=2)
    assert tp1 == tp2
    assert len({tuple(t) for t in tp1[0:1] + tp1[1:2]}) == 2  # not a constant model
