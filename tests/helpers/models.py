"""Tiny random checkpoints built with transformers' own classes, a small sub-word tokenizer
trained here, and HF transformers' greedy reference."""

from __future__ import annotations

from pathlib import Path


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
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def greedy_engine_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: int, **engine_args):
    """zllm's fp32 greedy tokens for `prompts` (EOS ignored), and the shut-down LLM, whose stats
    (preemptions, blocks) a test may still read."""
    from zllm import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", **engine_args)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], llm


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
        pad_token_id=0,  # Phi-3's default (32000) lies outside a tiny vocabulary
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


# The special tokens of SmolLM2's tokenizer, at its ids: <|im_end|> (2) is EOS, as in
# save_tiny_model's config.
SUBWORD_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_subword_tokenizer(corpus: list[str], vocab_size: int = 1024):
    """A byte-level BPE tokenizer (GPT-2's and SmolLM2's kind) trained on `corpus` with the
    `tokenizers` library: every byte is a token and merges make multi-character tokens, so any
    text encodes and grammars see real sub-word tokens. Returns a transformers fast tokenizer
    (save it with `save_pretrained`); its length is the vocabulary size, at most `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SUBWORD_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")


# ---- MXFP4 (GPT-OSS's expert format) -----------------------------------------------------------

_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(weight):
    """weight [..., out, in] (in divisible by 32) as MXFP4 is stored: (blocks uint8 [..., out,
    in / 32, 16], two E2M1 codes a byte with the even value in the low nibble; scales uint8
    [..., out, in / 32], E8M0 exponents biased by 127, each the smallest that brings its 32
    values within E2M1's +-6). Each value rounds to the nearest E2M1 value."""
    import torch

    *lead, cols = weight.shape
    groups = weight.float().reshape(*lead, cols // 32, 32)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitude = (scaled.abs()[..., None] - torch.tensor(_FP4_MAGNITUDES)).abs().argmin(dim=-1)
    codes = (magnitude | (((scaled < 0) & (magnitude > 0)).to(torch.int64) << 3)).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), (exponent + 127).to(torch.uint8)


def mxfp4_round_trip(weight):
    """The values MXFP4 keeps of weight [..., out, in]: each 32-value group's E2M1 codes of
    quantize_mxfp4 times its power-of-two scale, in float32 (exact: E2M1 times 2^e fits)."""
    import torch

    blocks, scales = quantize_mxfp4(weight)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).to(torch.int64)
    magnitude = torch.tensor(_FP4_MAGNITUDES)[codes & 0x7]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    values = values * torch.exp2(scales.float() - 127)[..., None]
    return values.reshape(weight.shape)


def write_mxfp4_reference(model_dir: Path, reference_dir: Path) -> Path:
    """A copy of a GPT-OSS checkpoint saved by transformers with every expert tensor replaced by
    the values its MXFP4 form keeps (mxfp4_round_trip), stored plain in float32: a reference that
    any transformers version reads without its MXFP4 integration (5.17's, on the GPU machines,
    dequantizes the experts to bfloat16 whatever dtype is asked: its fp32 forward fails on CPU)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, reference_dir)
    path = reference_dir / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name] = mxfp4_round_trip(tensors[name].transpose(-1, -2)).transpose(-1, -2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    return reference_dir


def scale_gpt_oss_gate_up(model_dir: Path, factor: float) -> Path:
    """A GPT-OSS checkpoint saved by transformers with every expert's gate_up projection (weight
    and bias) times `factor`, so that the tiny model's gate and up values pass GPT-OSS's own
    SwiGLU clamp (swiglu_limit 7.0) and the clamp is exercised without a test-only limit. A power
    of two keeps the MXFP4 codes of write_mxfp4_experts (only the scales move)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias"))]:
        tensors[name] = tensors[name] * factor
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


def write_mxfp4_experts(model_dir: Path) -> Path:
    """A GPT-OSS checkpoint saved by transformers rewritten as OpenAI ships it: every expert
    tensor (experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H]) replaced by its MXFP4
    `_blocks` and `_scales` over the stored [E, out, in] matrix, and config.json's
    quantization_config saying mxfp4, which transformers' mxfp4 integration reads (and on CPU
    dequantizes)."""
    import json

    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(tensors.pop(name).transpose(-1, -2))
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_MODULES_NOT_CONVERTED}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


FP8_BLOCK_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


def randomize_correction_bias(model_dir: Path) -> None:
    """HF starts DeepSeek-V3's e_score_correction_bias at zero; a random one changes which experts
    are picked."""
    import torch
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    names = [name for name in tensors if name.endswith("e_score_correction_bias")]
    assert names
    for name in names:
        tensors[name] = torch.rand(tensors[name].shape, generator=generator) * 0.5
    save_file(tensors, path, metadata={"format": "pt"})


# A tiny DeepSeek-V3 for FP8 weights kept as stored at up to 8 ranks (issue 38): kept FP8 weights
# split only on 128-row tiles, so each rank's share at tp 8 is whole tiles (8 heads, one a rank:
# q_b_proj 128 + 128 rows a head, kv_b_proj 128 + 128, o_proj 128 columns; the experts' and the
# dense MLP's 1024 rows, 128 a rank); noaux_tc routing over 16 experts in 8 groups, YaRN. Every
# matrix dimension is at most 128 or a multiple of it: transformers' reader (the reference) cuts a
# matrix into as many equal blocks as its scale grid has (160 rows, 2 scales: 80-row blocks), where
# DeepSeek's layout has 128-row tiles and a short last one.
TINY_V3_FP8 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=1024,
    moe_intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=24,
    kv_lora_rank=128,
    qk_nope_head_dim=128,
    qk_rope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=16,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    rope_parameters={
        "rope_theta": 10000.0,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    initializer_range=0.2,
)


def save_tiny_v3_fp8(directory: Path) -> Path:
    """TINY_V3_FP8 with a random correction bias, in DeepSeek-V3's FP8 release layout."""
    model_dir = save_tiny_model(directory, "deepseek_v3", **TINY_V3_FP8)
    randomize_correction_bias(model_dir)
    return write_fp8_block_weights(model_dir)


def write_fp8_block_weights(model_dir: Path) -> Path:
    """A DeepSeek checkpoint saved by transformers rewritten in the layout of DeepSeek-V3's FP8
    release: every linear weight of the decoder layers (attention projections, dense MLPs,
    shared and routed experts; not the router, norms, embeddings or lm_head) as float8_e4m3fn
    `X.weight` and fp32 `X.weight_scale_inv`, one scale per 128x128 block (value = fp8 x scale),
    and config.json's quantization_config saying so, which transformers' finegrained_fp8
    integration reads (on CPU it dequantizes)."""
    import json

    from safetensors.torch import load_file, save_file

    from zllm.workers.fp8 import quantize_blocks

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    linear = [n for n, t in tensors.items() if ".layers." in n and t.dim() == 2 and not n.endswith("mlp.gate.weight")]
    for name in linear:
        tensors[name], tensors[f"{name}_scale_inv"] = quantize_blocks(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = dict(FP8_BLOCK_QUANTIZATION)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir
