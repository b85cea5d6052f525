"""Gemma 2, Gemma 3, Phi-3 and Mistral's sliding window against HF transformers (fp32, CPU), on
tiny random checkpoints made by transformers itself, with windows shorter than the prompts.

Each compares the engine's greedy tokens with HF generate's exactly, and the log-probability of
every token of prompt and output (prompt_logprobs and logprobs) with HF's log-softmax over one
full forward of the whole sequence. Every case also checks that the comparison sees the window:
HF without it gives log-probabilities far from the engine's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.models import hf_greedy, save_tiny_model
from zllm import LLMEngine, SamplingParams

WINDOW = 12
# Prompt lengths around and past the window; the 5-token prompt's decode crosses it.
PROMPTS = [[7, 3, 9, 11, 5], list(range(3, 40)), [7] * 5 + list(range(100, 140)), list(range(200, 213))]
MAX_TOKENS = 16
LOGPROB_ATOL = 2e-4  # fp32, different summation orders

ALTERNATING = ["sliding_attention", "full_attention"] * 2
CASES = {  # name: (architecture, config overrides)
    # Gemma 2: local and global layers, attention and final logits soft-capped (small caps, so the
    # tanh bends the scores of a tiny model), query_pre_attn_scalar apart from head_dim, GeGLU,
    # four (1 + w) norms a layer, scaled tied embeddings.
    "gemma2": (
        "gemma2",
        dict(
            sliding_window=WINDOW,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 3: q/k norms, local layers with their own rotary base, global ones with linear scaling.
    "gemma3": (
        "gemma3",
        dict(
            sliding_window=WINDOW,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            layer_types=ALTERNATING,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
            rope_local_base_freq=100.0,
            tie_word_embeddings=True,
        ),
    ),
    # Phi-3 (mini 4k's shape of config): fused qkv_proj and gate_up_proj, a window in every layer.
    "phi3": ("phi3", dict(sliding_window=WINDOW, num_hidden_layers=2)),
    "mistral": ("mistral", dict(sliding_window=WINDOW, head_dim=32)),
}


def _save(tmp_path: Path, case: str, **extra) -> Path:
    architecture, overrides = CASES[case]
    return save_tiny_model(tmp_path / case, architecture, initializer_range=0.2, **{**overrides, **extra})


def _hf_model(model_dir: Path, **config_changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in config_changes.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()


def _hf_logprobs(model, sequence: list[int]) -> torch.Tensor:
    """log p(sequence[t] | sequence[:t]) for t >= 1, from one forward of the whole sequence."""
    with torch.inference_mode():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]


def _engine_results(engine: LLMEngine, prompts: list[list[int]], stagger: bool = False, prompt_logprobs: bool = True):
    """(tokens, log p of every prompt (with prompt_logprobs) and output token after the first,
    cached prompt tokens) per prompt; with stagger, each request joins the running batch one step
    after the previous. A request that asks for prompt logprobs takes no prefix-cache hit."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        logprobs=1,
        prompt_logprobs=1 if prompt_logprobs else None,
    )
    pending, results = list(enumerate(prompts)), {}
    while pending or engine.has_unfinished_requests():
        for _ in range(1 if stagger else len(pending)):
            if pending:
                i, ids = pending.pop(0)
                engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    rows = []
    for i, prompt in enumerate(prompts):
        out = results[str(i)]
        tokens = out.outputs[0].token_ids
        prompt_lp = (
            [out.prompt_logprobs[t][prompt[t]].logprob for t in range(1, len(prompt))] if prompt_logprobs else []
        )
        output_lp = [step[token].logprob for step, token in zip(out.outputs[0].logprobs, tokens)]
        rows.append((tokens, torch.tensor(prompt_lp + output_lp), out.num_cached_tokens))
    return rows


def _assert_matches_hf(
    model_dir: Path, prompts: list[list[int]], stagger: bool = False, prompt_logprobs: bool = True, **engine_args
) -> list:
    engine = LLMEngine.from_engine_args(str(model_dir), dtype="float32", **engine_args)
    rows = _engine_results(engine, prompts, stagger, prompt_logprobs)
    hf = _hf_model(model_dir)
    for prompt, (tokens, logprobs, _) in zip(prompts, rows):
        assert tokens == hf_greedy(hf, prompt, MAX_TOKENS, eos_token_id=None)
        expected = _hf_logprobs(hf, prompt + tokens)[-len(logprobs) :]
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=LOGPROB_ATOL)
    return rows


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_hf_past_the_window(tmp_path, case):
    model_dir = _save(tmp_path, case)
    rows = _assert_matches_hf(model_dir, PROMPTS)
    # The window matters: HF with a window longer than every sequence disagrees with the engine.
    unwindowed = _hf_model(model_dir, sliding_window=4096)
    prompt, (tokens, logprobs, _) = PROMPTS[2], rows[2]
    assert (logprobs - _hf_logprobs(unwindowed, prompt + tokens)).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "phi3"])
def test_chunked_prefill_and_prefix_cache_match_hf(tmp_path, case):
    """8-token steps (every prompt chunked across the window), 8-token blocks, requests joining a
    running batch one step apart and sharing a 24-token prefix (prefix-cache hits longer than the
    window): HF's tokens and output log-probabilities still (prompt logprobs would skip the cache)."""
    model_dir = _save(tmp_path, case)
    prefix = list(range(10, 34))
    prompts = [prefix + [100 + i, 7, 8 + i] for i in range(3)] + [prefix[:5]]
    rows = _assert_matches_hf(
        model_dir,
        prompts,
        stagger=True,
        prompt_logprobs=False,
        block_size=8,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    )
    assert max(cached for _, _, cached in rows) >= 16  # later requests found the shared full blocks


def test_piecewise_forward_matches_hf(tmp_path):
    """piecewise_cuda_graphs (on CPU the pieces run eagerly): Gemma 3's local and global rotaries
    and scaled embeddings reach each piece."""
    from zllm.workers.piecewise_graphs import EagerPieces

    model_dir = _save(tmp_path, "gemma3")
    engine = LLMEngine.from_engine_args(str(model_dir), dtype="float32", piecewise_cuda_graphs=True)
    assert isinstance(engine.core.executor.runner.pieces, EagerPieces)
    hf = _hf_model(model_dir)
    for prompt, (tokens, logprobs, _) in zip(PROMPTS, _engine_results(engine, PROMPTS)):
        assert tokens == hf_greedy(hf, prompt, MAX_TOKENS, eos_token_id=None)
        torch.testing.assert_close(logprobs, _hf_logprobs(hf, prompt + tokens), rtol=0, atol=LOGPROB_ATOL)


# ---- Phi-3: LongRoPE, partial rotary, fused tensors at tp 2 ---------------------------------------

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.5], "long_factor": [1.5, 3.0, 7.0, 20.0]}
ORIGINAL_MAX = 32


def _save_longrope(tmp_path: Path) -> Path:
    """Phi-4-mini's kind of config: LongRoPE over half of each head (partial_rotary_factor 0.5),
    pretrained on 32 positions, extended to 128."""
    return save_tiny_model(
        tmp_path / "phi3-longrope",
        "phi3",
        initializer_range=0.2,
        head_dim=16,
        partial_rotary_factor=0.5,
        max_position_embeddings=128,
        original_max_position_embeddings=ORIGINAL_MAX,
        rope_scaling=LONGROPE,
    )


def test_longrope_short_factors_below_the_original_length(tmp_path):
    """max_model_len <= original_max_position_embeddings: the short factors, as HF uses them for
    every sequence that short."""
    model_dir = _save_longrope(tmp_path)
    _assert_matches_hf(model_dir, [[5, 9, 13], list(range(3, 16))], max_model_len=ORIGINAL_MAX)


def test_longrope_long_factors_when_max_model_len_exceeds_the_original_length(tmp_path):
    """max_model_len > original_max_position_embeddings: the long factors for every sequence (as
    vLLM), which is what HF uses for a prompt longer than the original length."""
    model_dir = _save_longrope(tmp_path)
    long_prompts = [list(range(3, 40)), [7] * 5 + list(range(100, 140))]
    _assert_matches_hf(model_dir, long_prompts, max_model_len=128)
    # A sequence within the original length keeps HF's short factors; this engine rotates it by
    # the long ones (the choice is made once, rope_uses_long_factors), so it differs there.
    engine = LLMEngine.from_engine_args(str(model_dir), dtype="float32", max_model_len=128)
    prompt = list(range(3, 16))
    ((tokens, logprobs, _),) = _engine_results(engine, [prompt])
    assert (logprobs - _hf_logprobs(_hf_model(model_dir), prompt + tokens)).abs().max() > 1e-2


def test_phi3_fused_tensors_split_at_tp2(tmp_path):
    """Each rank reads its heads' rows of each part of qkv_proj and its rows of gate and up from
    the fused tensors (gloo, two worker processes): HF's tokens."""
    from zllm import LLM

    model_dir = _save(tmp_path, "phi3")
    hf = _hf_model(model_dir)
    expected = [hf_greedy(hf, p, MAX_TOKENS, eos_token_id=None) for p in PROMPTS]
    llm = LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=8 << 20)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_phi3_missing_fused_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from zllm import LLM

    model_dir = _save(tmp_path, "phi3")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"^model: checkpoint in .* lacks tensor\(s\) model.layers.1.self_attn.qkv_proj.weight$"
    ):
        LLM(str(model_dir), dtype="float32")


def test_sliding_window_no_longer_caps_max_model_len(tmp_path):
    from zllm import LLM

    model_dir = _save(tmp_path, "mistral")
    assert json.loads((model_dir / "config.json").read_text())["sliding_window"] == WINDOW
    assert LLM(str(model_dir), dtype="float32").engine.config.max_model_len == 512  # max_position_embeddings


def test_multimodal_gemma3_is_refused_with_the_supported_list(tmp_path):
    """Gemma3ForConditionalGeneration (vision tower, text_config) is not served: refused before
    any worker starts, naming what is."""
    from transformers import Gemma3Config

    from zllm import LLM
    from zllm.model_spec import MODEL_REGISTRY

    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28)
    config = Gemma3Config(text_config=dict(num_hidden_layers=2, hidden_size=64), vision_config=vision)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"^model: architecture \['Gemma3ForConditionalGeneration'\] is not supported"
    ) as error:
        LLM(str(tmp_path))
    assert "Gemma3ForCausalLM" in str(error.value) and all(name in str(error.value) for name in MODEL_REGISTRY)
