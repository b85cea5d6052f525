"""The FP8 KV cache (--kv-cache-dtype fp8) on CPU: keys and values stored as E4M3 (divided by the
checkpoint's k_scale / v_scale, else 1.0), read back times the scale. The reference is
transformers' model with its rotated keys and its values rounded the same way before attention,
token for token, at tp 1 and 2, through chunked prefill and prefix-cache hits; plus the doubled
(here: quadrupled, over fp32) block count, the startup log, and what is refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.helpers.engine import PROMPTS, engine_generate_all
from tests.helpers.fp8 import MAX_TOKENS, fp8_kv_rounding, perplexity, token_fake_quant, write_compressed_tensors
from tests.helpers.models import hf_greedy, save_tiny_llama
from zllm.config import EngineConfig
from zllm.workers.attention import KV_FP8


def _greedy(model) -> list[list[int]]:
    return [hf_greedy(model, p, MAX_TOKENS, eos_token_id=None) for p in PROMPTS]


def _hf_reference(model_dir: Path, scales=None, round_kv: bool = True) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if not round_kv:
        return _greedy(model)
    with fp8_kv_rounding(model, scales):
        return _greedy(model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # initializer_range 0.2: keys and values of a few units, where E4M3's 3 mantissa bits show.
    return save_tiny_llama(tmp_path_factory.mktemp("kv8") / "m", initializer_range=0.2)


def test_fp8_kv_cache_matches_transformers_with_rounded_keys_and_values(tiny):
    reference = _hf_reference(tiny)
    assert reference != _hf_reference(tiny, round_kv=False)  # the rounding matters here
    assert engine_generate_all(tiny, PROMPTS, MAX_TOKENS, kv_cache_dtype="fp8") == reference


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(tensor_parallel_size=2),
        # Prompts cut into 8-token chunks: each chunk attends to its prefix read back from FP8.
        dict(max_num_batched_tokens=8, enable_prefix_caching=False),
    ],
    ids=["tp2", "chunked-prefill"],
)
def test_fp8_kv_cache_under_tp_and_chunked_prefill(tiny, engine_args):
    reference = _hf_reference(tiny)
    assert engine_generate_all(tiny, PROMPTS, MAX_TOKENS, kv_cache_dtype="fp8_e4m3", **engine_args) == reference


def test_fp8_kv_cache_prefix_hits_read_the_stored_blocks(tiny):
    """A prompt that shares its first blocks with an earlier one reuses them from the FP8 cache."""
    from zllm import LLM, SamplingParams

    reference = _hf_reference(tiny)
    llm = LLM(str(tiny), dtype="float32", kv_cache_dtype="fp8", block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        first = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
        again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert again.num_cached_tokens >= 32
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == reference[1]


# ---- checkpoint scales -------------------------------------------------------------------------


def _calibrated_kv_scales(model_dir: Path) -> list[tuple[float, float]]:
    """Per layer: the largest rotated key and value over PROMPTS / 448 (what llm-compressor's
    observer stores as k_scale / v_scale)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax = [[0.0, 0.0] for _ in model.model.layers]
    layer = [0]
    rotary = modeling_llama.apply_rotary_pos_emb

    def record_keys(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        amax[layer[0]][0] = max(amax[layer[0]][0], k.abs().max().item())
        return q, k

    modeling_llama.apply_rotary_pos_emb = record_keys
    try:
        for index, decoder in enumerate(model.model.layers):
            decoder.self_attn.register_forward_pre_hook(lambda mod, args, index=index: layer.__setitem__(0, index))
            decoder.self_attn.v_proj.register_forward_hook(
                lambda mod, args, out, index=index: amax[index].__setitem__(
                    1, max(amax[index][1], out.abs().max().item())
                )
            )
        with torch.no_grad():
            for prompt in PROMPTS:
                model(torch.tensor([prompt + list(range(60, 80))]))
    finally:
        modeling_llama.apply_rotary_pos_emb = rotary
    # float32, as the checkpoint stores them: the reference then uses the engine's values exactly.
    return [(_float32(k / 448.0), _float32(v / 448.0)) for k, v in amax]


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def test_checkpoint_kv_scales_are_used_by_the_fp8_cache(tmp_path):
    """A compressed-tensors FP8_DYNAMIC checkpoint with a kv_cache_scheme and per-layer
    self_attn.k_scale / v_scale: --kv-cache-dtype fp8 divides by them; the model-dtype cache
    ignores them."""
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src = save_tiny_llama(tmp_path / "src", initializer_range=0.2)
    weights_only = write_compressed_tensors(src, tmp_path / "fp8", "FP8_DYNAMIC", ["lm_head"])
    scales = _calibrated_kv_scales(src)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            module.register_forward_pre_hook(lambda mod, args: (token_fake_quant(args[0], 1),))
    with fp8_kv_rounding(model, scales):
        reference = _greedy(model)
    with fp8_kv_rounding(model):
        assert _greedy(model) != reference  # the scales matter here

    _add_kv_scales(tmp_path / "fp8", scales, load_file, save_file)
    assert engine_generate_all(tmp_path / "fp8", PROMPTS, MAX_TOKENS, kv_cache_dtype="fp8") == reference
    assert engine_generate_all(tmp_path / "fp8", PROMPTS, MAX_TOKENS) == weights_only


def _add_kv_scales(model_dir: Path, scales, load_file, save_file) -> None:
    [path] = model_dir.glob("*.safetensors")
    tensors = load_file(str(path))
    for index, (k, v) in enumerate(scales):
        tensors[f"model.layers.{index}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        tensors[f"model.layers.{index}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    (model_dir / "config.json").write_text(json.dumps(config))


# ---- capacity, the log, refusals ----------------------------------------------------------------


def test_fp8_kv_cache_holds_more_blocks_in_the_same_memory_and_says_so(tiny, caplog):
    from zllm.workers.model_runner import ModelRunner

    runners = {}
    for kv_dtype in ("auto", "fp8"):
        for dtype in ("float32", "bfloat16"):
            config = EngineConfig.create(
                str(tiny), dtype=dtype, device="cpu", kv_cache_dtype=kv_dtype, kv_cache_memory_bytes=1 << 24
            )
            runners[kv_dtype, dtype] = ModelRunner(config, torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="zllm.workers.model_runner"):
        blocks = {key: runner.determine_num_kv_blocks() for key, runner in runners.items()}
    assert blocks["fp8", "float32"] == blocks["fp8", "bfloat16"] == 4 * blocks["auto", "float32"]
    assert blocks["fp8", "bfloat16"] == 2 * blocks["auto", "bfloat16"]
    assert "in fp8_e4m3 (1 byte per value: 2x the tokens of a bfloat16 cache)" in caplog.text
    runner = runners["fp8", "bfloat16"]
    runner.initialize_kv_cache(3)
    assert {c.dtype for c in runner.kv_caches} == {KV_FP8}


def test_bad_kv_cache_dtype_and_scheme_are_refused(tmp_path, capsys):
    import argparse

    from zllm.launch.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert engine_kwargs(parser.parse_args([]))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert "invalid choice: 'fp8_e5m2'" in capsys.readouterr().err
    model_dir = save_tiny_llama(tmp_path / "m")
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineConfig.create(str(model_dir), kv_cache_dtype="int8")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
            }
        },
        "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False},
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="kv_cache_scheme .* is not supported"):
        EngineConfig.create(str(model_dir))


# ---- the real model ---------------------------------------------------------------------------


def test_fp8_kv_cache_smollm2_perplexity(smollm2_dir):
    """The real weights: an FP8 KV cache at scale 1.0 moves the passage's perplexity by under 3%."""
    fp32 = perplexity(smollm2_dir, dtype="float32")
    fp8_kv = perplexity(smollm2_dir, dtype="float32", kv_cache_dtype="fp8")
    assert fp8_kv != fp32 and abs(fp8_kv - fp32) / fp32 < 0.03, (fp32, fp8_kv)
