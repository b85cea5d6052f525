"""Write a model directory of a given shape for `--load-format dummy` runs (no weights needed).

    python benchmarks/dummy_model.py llama3-8b /tmp/llama3-8b
    python benchmarks/dummy_model.py llama3-70b /tmp/llama3-70b
    python benchmarks/dummy_model.py eagle3-llama3.1-8b /tmp/eagle3-8b    (an EAGLE-3 head for llama3-8b; also eagle-llama3-8b)
    python benchmarks/dummy_model.py llama3.2-1b /tmp/llama3.2-1b           (small and quick to start: tied embeddings)
    python benchmarks/dummy_model.py qwen3-30b-a3b /tmp/qwen3-30b-a3b     (MoE: 128 experts, top 8)
    python benchmarks/dummy_model.py mixtral-8x7b /tmp/mixtral-8x7b       (MoE: 8 experts, top 2)
    python benchmarks/dummy_model.py gemma3-12b /tmp/gemma3-12b           (sliding windows, head_dim 256)
    python benchmarks/dummy_model.py phi4 /tmp/phi4                       (Phi-3 architecture, 14B)
    python benchmarks/dummy_model.py deepseek-v2-lite /tmp/deepseek-v2-lite (MLA; 16B, 2.4B active)
    python benchmarks/dummy_model.py gpt-oss-20b /tmp/gpt-oss-20b         (sinks, windows; MXFP4 experts)
    python benchmarks/dummy_model.py deepseek-v3 /tmp/deepseek-v3         (671B, 37B active; MLA, 256 experts; block FP8)
    python benchmarks/dummy_model.py llama3.1-405b /tmp/llama3.1-405b     (FP8 weights: per channel, tokens dynamic)
    python benchmarks/dummy_model.py deepseek-v3-small /tmp/v3-small      (V3's layers, fewer and narrower: fp32 tp checks)
    python benchmarks/dummy_model.py qwen2.5-vl-7b /tmp/qwen2.5-vl-7b     (vision-language: benchmarks/vision.py)
    python benchmarks/dummy_model.py llama3-8b /tmp/llama3-8b-bpe --tokenizer DIR

--tokenizer copies a real tokenizer (tokenizer.json, tokenizer_config.json) from DIR, e.g. the
embedded SmolLM2's, and makes the model's vocabulary the tokenizer's: grammars (structured
outputs) need real sub-word tokens, and xgrammar's bitmask costs grow with every model id the
tokenizer lacks (79k of them for SmolLM2's 49k tokens under Llama-3's 128k: about 5x the fill
time), which real checkpoints, padded by a few hundred ids at most, do not have.

The directory gets config.json and generation_config.json for the shape, plus a placeholder
word-level tokenizer so the frontend can start (no model files needed, so it works on machines
without network); benchmarks send token ids and set detokenize=False.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    # EAGLE heads for llama3-8b (speculative_config {"method": "eagle" | "eagle3", "model": DIR}
    # with --load-format dummy: random heads, so every draft is rejected; what they time is the
    # proposing). The published heads' configs: yuhuili/EAGLE-LLaMA3-Instruct-8B and
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (one layer; EAGLE-3 drafts over 32000 tokens).
    "eagle-llama3-8b": dict(
        hidden_size=4096,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "eagle3-llama3.1-8b": dict(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=4096,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        draft_vocab_size=32000,
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
    ),
    # One rank's share of llama3-70b at tp 4, as a whole model on one GPU: its W2 against the tp 4
    # run's is what the all-reduces and the other ranks cost (the LM head's share of the vocabulary
    # too; the embedding is bigger than a rank's, but a decode step reads one row of it).
    "llama3-70b-shard4": dict(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=7168,
        vocab_size=32064,
    ),
    "llama3.2-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    # Mixture of experts (the published configs' shapes; ~61 GB and ~93 GB in bf16).
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=151936,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        rope_theta=1000000.0,
    ),
    # Issue 31's shapes (the published configs): Gemma 3 12B's text model (five 1024-token sliding
    # layers to one global, head_dim 256, tied 262k embeddings) and Phi-4 (14B, GQA 40/10).
    "gemma3-12b": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        hidden_size=3840,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        intermediate_size=15360,
        vocab_size=262208,
        sliding_window=1024,
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(48)],
        query_pre_attn_scalar=256,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "phi4": dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=10,
        intermediate_size=17920,
        vocab_size=100352,
        rope_theta=250000.0,
        max_position_embeddings=16384,
        sliding_window=None,
    ),
    # Issue 32's shapes (the published configs). DeepSeek-V2-Lite: MLA (512 + 64 latent, no
    # q_lora_rank), YaRN, one dense layer, then 64 routed experts (top 6) and 2 shared.
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"],
        model_type="deepseek_v2",
        hidden_size=2048,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=102400,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        bos_token_id=100000,
        eos_token_id=100001,
    ),
    # Issue 38's shapes. DeepSeek-V3 (and R1): deepseek-ai/DeepSeek-V3's config.json (without the
    # multi-token-prediction layer): MLA with q_lora_rank, 3 dense layers, then 256 routed experts
    # (top 8, noaux_tc over 8 groups) and 1 shared; its release's 128x128 block-FP8 weights, which
    # --load-format dummy quantizes per tile and CUDA workers keep in FP8 (ZLLM_FP8_BLOCKS).
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=129280,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        bos_token_id=0,
        eos_token_id=1,
    ),
    # DeepSeek-V3's kind of layer, small enough for fp32 on 4 or 8 GPUs (issue 38's tp 8 vs tp 4
    # agreement): block FP8, MLA with q_lora_rank, 1 dense layer then 3 MoE ones of 64 experts (top
    # 8 over 8 groups) and 1 shared; every tp-8 shard whole 128-row tiles (16 heads: 2 a rank).
    "deepseek-v3-small": dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_size=2048,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=8192,
        moe_intermediate_size=1024,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=129280,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        bos_token_id=0,
        eos_token_id=1,
    ),
    # Llama-3.1-405B-Instruct's config with FP8 weights as RedHatAI's / Meta's FP8 releases hold
    # them: a scale per output channel, activations quantized per token on the fly (compressed-
    # tensors FP8_DYNAMIC; --load-format dummy quantizes the random weights the same way).
    "llama3.1-405b": dict(
        hidden_size=16384,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        quantization_config={
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "channel",
                        "dynamic": False,
                        "symmetric": True,
                    },
                    "input_activations": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "token",
                        "dynamic": True,
                        "symmetric": True,
                    },
                }
            },
            "ignore": ["lm_head"],
        },
    ),
    # gpt-oss-20b: 24 layers, sinks, a 128-token window on every other layer, 32 experts (top 4)
    # stored as MXFP4 (dummy weights: random E2M1 codes, scales of 2^-6).
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
        sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        attention_bias=True,
        swiglu_limit=7.0,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=131072,
        quantization_config={
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
        bos_token_id=199998,
        eos_token_id=200002,
    ),
}


def write_placeholder_tokenizer(target: Path, vocab_size: int = 256) -> None:
    """A word-level tokenizer over the words t0..t{n-1}; t1 is BOS, t2 EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t2", bos_token="t1").save_pretrained(target)


def write_dummy_model(shape: str, target: Path, tokenizer: Path | None = None) -> Path:
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
    )
    config.update(SHAPES[shape])
    if config["vocab_size"] == 128256:  # Llama 3's special ids
        config.update(bos_token_id=128000, eos_token_id=128001)
    target.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        from transformers import AutoTokenizer

        real = AutoTokenizer.from_pretrained(tokenizer)
        config.update(vocab_size=len(real), bos_token_id=real.bos_token_id, eos_token_id=real.eos_token_id)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer / name).is_file():
                shutil.copyfile(tokenizer / name, target / name)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    if tokenizer is not None:
        return target
    # A word for every token id, so that streamed text has one word per generated token.
    write_placeholder_tokenizer(target, vocab_size=config["vocab_size"])
    return target


# Qwen2.5-VL-7B-Instruct's published config (issue 35's benchmark shape): the Qwen2 decoder with
# M-RoPE and the 32-block vision tower (window attention but in blocks 7, 15, 23, 31).
QWEN25_VL_7B = dict(
    architectures=["Qwen2_5_VLForConditionalGeneration"],
    model_type="qwen2_5_vl",
    torch_dtype="bfloat16",
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
    bos_token_id=151643,
    eos_token_id=151645,
    tie_word_embeddings=False,
    text_config=dict(
        model_type="qwen2_5_vl_text",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        hidden_act="silu",
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    vision_config=dict(
        model_type="qwen2_5_vl",
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        hidden_act="silu",
        in_chans=3,
        tokens_per_second=2,
    ),
)
QWEN_VISION_TOKENS = {"<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655}


def write_dummy_vlm(target: Path) -> Path:
    """Qwen2.5-VL-7B's shape: config.json, the image processor's config (Qwen's defaults) and a
    word-level tokenizer whose vision tokens sit at Qwen's ids (t<i> for every other id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(QWEN25_VL_7B, indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": QWEN25_VL_7B["eos_token_id"]}))
    preprocessor = dict(
        image_processor_type="Qwen2VLImageProcessor",
        do_convert_rgb=True,
        do_normalize=True,
        do_rescale=True,
        do_resize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        merge_size=2,
        patch_size=14,
        temporal_patch_size=2,
        resample=3,
        rescale_factor=1 / 255,
        size={"shortest_edge": 3136, "longest_edge": 12845056},
    )
    (target / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    special = {i: name for name, i in QWEN_VISION_TOKENS.items()}
    vocab = {special.get(i, f"t{i}"): i for i in range(QWEN25_VL_7B["text_config"]["vocab_size"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t151645", bos_token="t151643")
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_VISION_TOKENS)})
    tokenizer.save_pretrained(target)
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted([*SHAPES, "qwen2.5-vl-7b"]))
    parser.add_argument("target", type=Path)
    parser.add_argument("--tokenizer", type=Path, default=None, help="copy this directory's tokenizer")
    args = parser.parse_args()
    if args.shape == "qwen2.5-vl-7b":
        print(write_dummy_vlm(args.target))
    else:
        print(write_dummy_model(args.shape, args.target, args.tokenizer))
