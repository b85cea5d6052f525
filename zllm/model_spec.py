"""The shape of a model, read once from its HF config, and the registry of supported architectures.

Plain Python (no torch, no worker code), below every process: `EngineConfig.create` reads the
spec in the frontend to refuse an unsupported architecture, to size `max_model_len` and to check
the tensor-parallel split before any worker starts; the workers build their model from it
(zllm/workers/models/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from zllm.quantization import QuantSpec, checkpoint_quantization

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class Architecture:
    """How one HF architecture differs from plain Llama. A bias flag left None follows the
    config (`attention_bias` for q/k/v and o, `mlp_bias` for the MLP), as HF's Llama does."""

    qkv_bias: bool | None = None
    o_proj_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on each query and key head, before rotary
    moe: MoeFormat | None = None  # a Mixture-of-Experts model: how its config and checkpoint say so
    gemma: bool = False  # Gemma 2/3: the (1 + w) RMSNorm, four norms a layer, embeddings times sqrt(hidden)
    fused_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj fused
    mla: bool = False  # DeepSeek-V2/V3: multi-head latent attention (MlaSpec)
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head joins each softmax


@dataclass(frozen=True, slots=True)
class MoeFormat:
    """Where an MoE architecture keeps its experts: the config's field names and the checkpoint's
    tensor names (`model.layers.N.<block>.experts.E.<gate|up|down>.weight`)."""

    block: str  # the MoE block's name in a layer: "block_sparse_moe" (Mixtral) or "mlp" (Qwen)
    expert_parts: tuple[str, str, str]  # gate, up, down projections of one expert
    num_experts_key: str
    intermediate_key: str
    always_renormalize: bool = False  # Mixtral renormalizes the top-k always; Qwen per norm_topk_prob
    fp32_routing_weights: bool = False  # Mixtral keeps the weights fp32; Qwen casts them to the model dtype
    sparse_layer_keys: bool = False  # Qwen: decoder_sparse_step and mlp_only_layers pick the MoE layers
    # DeepSeek-V2/V3: first_k_dense_replace dense layers, then MoE; n_shared_experts ungated shared
    # experts (`shared_experts`); grouped routing (topk_method, n_group, topk_group) and
    # routed_scaling_factor; V3's sigmoid scores with e_score_correction_bias ("noaux_tc").
    deepseek: bool = False
    # GPT-OSS (models/gpt_oss.py): a router with a bias, softmax over the top k logits, experts
    # with biases and the clamped SwiGLU, stored fused (and in MXFP4 in OpenAI's checkpoints).
    gpt_oss: bool = False


_MIXTRAL = MoeFormat(
    "block_sparse_moe",
    ("w1", "w3", "w2"),
    "num_local_experts",
    "intermediate_size",
    always_renormalize=True,
    fp32_routing_weights=True,
)
_QWEN_MOE = MoeFormat(
    "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size", sparse_layer_keys=True
)
_DEEPSEEK_MOE = MoeFormat(
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    "n_routed_experts",
    "moe_intermediate_size",
    fp32_routing_weights=True,
    deepseek=True,
)


_GPT_OSS_MOE = MoeFormat(
    "mlp", ("gate_up_proj", "gate_up_proj", "down_proj"), "num_local_experts", "intermediate_size", gpt_oss=True
)


# Keyed by `config.architectures`; every entry is the shared decoder in models/llama.py.
MODEL_REGISTRY: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(),  # Llama 2, 3, 3.1, 3.2; SmolLM2
    "MistralForCausalLM": Architecture(qkv_bias=False, o_proj_bias=False, mlp_bias=False),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, o_proj_bias=False, mlp_bias=False),  # Qwen2, Qwen2.5
    "Qwen3ForCausalLM": Architecture(mlp_bias=False, qk_norm=True),
    "MixtralForCausalLM": Architecture(qkv_bias=False, o_proj_bias=False, mlp_bias=False, moe=_MIXTRAL),
    "Qwen2MoeForCausalLM": Architecture(qkv_bias=True, o_proj_bias=False, mlp_bias=False, moe=_QWEN_MOE),
    "Qwen3MoeForCausalLM": Architecture(mlp_bias=False, qk_norm=True, moe=_QWEN_MOE),
    "Gemma2ForCausalLM": Architecture(mlp_bias=False, gemma=True),
    "Gemma3ForCausalLM": Architecture(mlp_bias=False, qk_norm=True, gemma=True),  # Gemma 3 1B, text-only
    "Phi3ForCausalLM": Architecture(qkv_bias=False, o_proj_bias=False, mlp_bias=False, fused_checkpoint=True),
    # DeepSeek-V2 / V2-Lite / V3: MLA (models/deepseek.py) and DeepSeek's MoE.
    "DeepseekV2ForCausalLM": Architecture(mlp_bias=False, moe=_DEEPSEEK_MOE, mla=True),
    "DeepseekV3ForCausalLM": Architecture(mlp_bias=False, moe=_DEEPSEEK_MOE, mla=True),
    # GPT-OSS 20B / 120B: biases on q/k/v/o (attention_bias), attention sinks, a window of 128 in
    # alternating layers, YaRN, MoE in every layer (models/gpt_oss.py).
    "GptOssForCausalLM": Architecture(mlp_bias=False, moe=_GPT_OSS_MOE, attention_sinks=True),
    # Vision-language models: the Qwen2 decoder with M-RoPE beside a vision transformer
    # (zllm/workers/models/qwen2_vl.py); the spec's `vision` says which tower.
    "Qwen2VLForConditionalGeneration": Architecture(qkv_bias=True, o_proj_bias=False, mlp_bias=False),
    "Qwen2_5_VLForConditionalGeneration": Architecture(qkv_bias=True, o_proj_bias=False, mlp_bias=False),
    # LLaVA: a CLIP or SigLIP vision tower and a projector before a Llama-family decoder (its text_config's).
    "LlavaForConditionalGeneration": Architecture(),
}
# LLaVA's vision towers: the vision_config's model_type -> VisionSpec.tower.
_LLAVA_TOWERS = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
# The vision-language architectures: their tower's kind (VisionSpec.kind).
VISION_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "LlavaForConditionalGeneration": "llava",
}


@dataclass(frozen=True, slots=True)
class PoolingArchitecture:
    """A pooling model (zllm/pooling.py): an encoder family and what its checkpoint's head is.

    family: "bert" (absolute positions from 0, token types), "xlm-roberta" (positions after
    padding_idx), "modernbert" (rotary positions, alternating global and sliding-window layers)
    or "decoder" (a causal decoder's layers, pooled at the last token); kind: "embed" (hidden
    states pooled) or "classify" (a sequence-classification head over the CLS token, or the mean
    for ModernBERT's classifier_pooling "mean"); default_pooling: where sentence-transformers'
    modules say nothing."""

    family: str
    kind: str = "embed"
    default_pooling: str = "cls"
    decoder: str | None = None  # family "decoder": the MODEL_REGISTRY entry whose layers it has


# Encoder-only, bidirectional models (zllm/workers/models/bert.py, modernbert.py), served by the
# pooling runner.
POOLING_REGISTRY: dict[str, PoolingArchitecture] = {
    "BertModel": PoolingArchitecture("bert"),
    "BertForSequenceClassification": PoolingArchitecture("bert", "classify"),
    "XLMRobertaModel": PoolingArchitecture("xlm-roberta"),
    "XLMRobertaForSequenceClassification": PoolingArchitecture("xlm-roberta", "classify"),
    # gte-modernbert-base; ModernBERT-base/large ship as ModernBertForMaskedLM: its encoder is
    # served (CLS-pooled), the MLM head is left in the checkpoint.
    "ModernBertModel": PoolingArchitecture("modernbert"),
    "ModernBertForMaskedLM": PoolingArchitecture("modernbert"),
    "ModernBertForSequenceClassification": PoolingArchitecture("modernbert", "classify"),
    # Decoders without their LM head (Qwen3-Embedding's `Qwen3Model`, gte-Qwen2's layers) and with a
    # sequence-classification head (`score`, over the last token).
    "Qwen3Model": PoolingArchitecture("decoder", "embed", "last", "Qwen3ForCausalLM"),
    "Qwen2Model": PoolingArchitecture("decoder", "embed", "last", "Qwen2ForCausalLM"),
    "LlamaModel": PoolingArchitecture("decoder", "embed", "last", "LlamaForCausalLM"),
    "Qwen2ForSequenceClassification": PoolingArchitecture("decoder", "classify", "last", "Qwen2ForCausalLM"),
    "Qwen3ForSequenceClassification": PoolingArchitecture("decoder", "classify", "last", "Qwen3ForCausalLM"),
    "LlamaForSequenceClassification": PoolingArchitecture("decoder", "classify", "last", "LlamaForCausalLM"),
}
ENCODER_ACTIVATIONS = ("gelu",)

# Configs without `architectures` (hand-written, or converted from GGUF by older zllm).
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "bert": "BertModel",
    "xlm-roberta": "XLMRobertaModel",
    "modernbert": "ModernBertModel",
}


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """A vision-language model's image side: its vision transformer, how images become tokens,
    and the language model's M-RoPE sections.

    Qwen2-VL: LayerNorm blocks with a GELU MLP, full attention within each image; Qwen2.5-VL:
    RMSNorm blocks with a SwiGLU MLP, window attention except in `full_attention_blocks`. Both
    embed patches of temporal x patch x patch pixels, rotate by 2-D (row, column) positions and
    merge spatial_merge_size^2 neighbouring patches into one language-model token.

    LLaVA: a CLIP vision transformer (class token, learned positions, pre-norm, quick-GELU MLP)
    or a SigLIP one (`tower` "siglip": no class token, no pre-norm, a patch convolution with a
    bias, tanh-GELU) whose `feature_layer`'s hidden states (without the first position for
    feature_select "default": CLIP's class token, SigLIP's first patch, as transformers drops it)
    go through the projector (linear, act, linear): one token per patch."""

    kind: str  # "qwen2_vl", "qwen2_5_vl" or "llava"
    depth: int
    hidden_size: int  # the tower's width
    num_heads: int
    intermediate_size: int  # its MLP's
    hidden_act: str
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    out_hidden_size: int  # the merger's output: the language model's hidden size
    image_token_id: int
    mrope_section: tuple[int, ...]  # rotary frequency pairs per position stream (t, h, w)
    window_size: int = 0  # Qwen2.5-VL: window attention's side in pixels
    full_attention_blocks: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    # LLaVA's CLIP tower and projector.
    image_size: int = 0
    layer_norm_eps: float = 1e-6
    feature_layer: int = -2
    feature_select: str = "default"  # "default": without the first position (CLIP's class token); "full": with it
    tower: str = "clip"  # LLaVA's vision transformer: "clip" or "siglip"
    projector_act: str = "gelu"
    projector_bias: bool = True

    @classmethod
    def from_hf_config(cls, hf_config, kind: str, text_rope: dict[str, Any]) -> VisionSpec:
        v = hf_config.vision_config
        if kind == "llava":
            return cls._llava(hf_config)
        qwen25 = kind == "qwen2_5_vl"
        width = v.hidden_size if qwen25 else v.embed_dim
        return cls(
            kind=kind,
            depth=v.depth,
            hidden_size=width,
            num_heads=v.num_heads,
            intermediate_size=v.intermediate_size if qwen25 else int(v.embed_dim * v.mlp_ratio),
            hidden_act=v.hidden_act,
            patch_size=v.patch_size,
            temporal_patch_size=v.temporal_patch_size,
            in_channels=getattr(v, "in_channels", None) or getattr(v, "in_chans", 3),
            spatial_merge_size=v.spatial_merge_size,
            out_hidden_size=v.out_hidden_size if qwen25 else v.hidden_size,
            image_token_id=int(hf_config.image_token_id),
            mrope_section=tuple(text_rope.get("mrope_section") or (16, 24, 24)),
            window_size=int(getattr(v, "window_size", 0) or 0) if qwen25 else 0,
            full_attention_blocks=tuple(getattr(v, "fullatt_block_indexes", ()) or ()) if qwen25 else (),
            rope_theta=float((getattr(v, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        )

    @classmethod
    def _llava(cls, hf_config) -> VisionSpec:
        v = hf_config.vision_config
        tower = _LLAVA_TOWERS.get(getattr(v, "model_type", "clip_vision_model"))
        if tower is None:
            raise ValueError(
                f"model: LLaVA's vision tower {v.model_type!r} is not supported ({', '.join(_LLAVA_TOWERS)})"
            )
        layer = hf_config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError("model: LLaVA with several vision_feature_layer values is not supported")
        return cls(
            kind="llava",
            depth=v.num_hidden_layers,
            hidden_size=v.hidden_size,
            num_heads=v.num_attention_heads,
            intermediate_size=v.intermediate_size,
            hidden_act=v.hidden_act,
            patch_size=v.patch_size,
            temporal_patch_size=1,
            in_channels=getattr(v, "num_channels", 3),
            spatial_merge_size=1,
            out_hidden_size=hf_config.get_text_config().hidden_size,
            image_token_id=int(getattr(hf_config, "image_token_id", None) or hf_config.image_token_index),
            mrope_section=(),
            image_size=v.image_size,
            layer_norm_eps=float(v.layer_norm_eps),
            feature_layer=layer,
            feature_select=hf_config.vision_feature_select_strategy,
            projector_act=hf_config.projector_hidden_act,
            projector_bias=bool(getattr(hf_config, "multimodal_projector_bias", True)),
            tower=tower,
        )

    @property
    def uses_mrope(self) -> bool:
        return self.kind != "llava"

    def tokens_of(self, grid: list[int]) -> int:
        """Language-model tokens of an image of grid (t, h, w) patches (LLaVA: its patches, CLIP's
        class token, less the first position that "default" drops, as LlavaProcessor counts)."""
        tokens = grid[0] * grid[1] * grid[2] // self.merge_unit
        if self.kind != "llava":
            return tokens
        return tokens + (self.tower == "clip") - (self.feature_select == "default")

    @property
    def merge_unit(self) -> int:
        """Patches per language-model token."""
        return self.spatial_merge_size**2


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Tokens a query may look back (HF: key kept when query - key < sliding_window), in the layers
    # `sliding_layers` names: every layer for Mistral and Phi-3, those `layer_types` marks
    # "sliding_attention" for Gemma and Qwen. None: every layer attends to its whole context.
    # ModernBERT's local layers look both ways: key kept when |query - key| < sliding_window
    # (local_attention // 2 + 1, as HF's attention module sets it).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None  # the config's torch_dtype, e.g. "bfloat16"
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type and its parameters
    partial_rotary_factor: float = 1.0  # rotary on the first int(head_dim * factor) dims only (Phi-4-mini)
    # Gemma 3: the sliding layers' rotary base and scaling (rope_local_base_freq); None: as the others.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] = field(default_factory=dict)
    hidden_act: str = "silu"  # the MLP gate's activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + w), in fp32
    sandwich_norms: bool = False  # Gemma 2/3: attention and MLP outputs normed too (four norms a layer)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    attention_scale: float | None = None  # None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores <- cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits <- cap * tanh(logits / cap)
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj stored fused
    moe: MoeSpec | None = None  # None: a dense model
    mla: MlaSpec | None = None  # DeepSeek's multi-head latent attention; None: per-head K and V
    attention_sinks: bool = False  # GPT-OSS: each head's learned sink logit joins its softmax
    quantization: QuantSpec | None = None  # the checkpoint's (config.json quantization_config); None: none
    # A 128x128 block-scaled FP8 checkpoint (quant_method fp8: DeepSeek-V3's) for a model whose
    # layers take no FP8 weights (MoE experts, MLA's absorbed kv_b_proj): the loader dequantizes
    # it to the model dtype (quantization is None then).
    dequantize_fp8_blocks: bool = False
    # That checkpoint's scheme: a CUDA worker keeps such weights in FP8 instead (ZLLM_FP8_BLOCKS,
    # quantization.keeps_fp8_blocks), weight-only, each layer dequantized before its product.
    block_fp8: QuantSpec | None = None
    # Encoder-only pooling models (POOLING_REGISTRY): token types, where positions start (XLM-R:
    # after padding_idx), the classifier's labels; rms_norm_eps holds their LayerNorm's eps.
    encoder: bool = False
    type_vocab_size: int = 0
    position_offset: int = 0
    num_labels: int = 0
    # ModernBERT: LayerNorms without a bias (norm_bias false), the classifier head's dense bias
    # (classifier_bias) and what it reads: the first token ("cls") or the mean of all ("mean").
    norm_bias: bool = True
    classifier_bias: bool = True
    classifier_pooling: str = "cls"
    vision: VisionSpec | None = None  # a vision-language model's image side
    # A decoder whose config says is_causal: false (gte-Qwen2's embedders, e.g. Qodo-Embed-1):
    # every token attends to the whole input. Served by the pooling runner only.
    bidirectional: bool = False

    @classmethod
    def from_hf_config(cls, hf_config) -> ModelSpec:
        architecture = pick_architecture(hf_config)
        if architecture in VISION_ARCHITECTURES:
            return cls._vision_language(hf_config, architecture)
        pooling = POOLING_REGISTRY.get(architecture)
        if pooling is not None and pooling.family == "modernbert":
            return cls._modernbert(hf_config, architecture)
        if pooling is not None and pooling.family != "decoder":
            return cls._encoder(hf_config, architecture)
        arch = MODEL_REGISTRY[architecture if pooling is None else pooling.decoder]
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope, local_rope = _rope_parameters(hf_config)
        window, sliding_layers = _sliding_layers(hf_config)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        quantization = None if _mxfp4_experts(hf_config, arch) else checkpoint_quantization(hf_config)
        dequantize = _dequantized_fp8_blocks(quantization, arch)
        return cls(
            architecture=architecture,
            model_type=hf_config.model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias if arch.qkv_bias is None else arch.qkv_bias,
            o_proj_bias=attention_bias if arch.o_proj_bias is None else arch.o_proj_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) if arch.mlp_bias is None else arch.mlp_bias,
            qk_norm=arch.qk_norm,
            sliding_window=window,
            sliding_layers=sliding_layers,
            checkpoint_dtype=_checkpoint_dtype(hf_config),
            rope_scaling=_without_theta(rope),
            partial_rotary_factor=_partial_rotary_factor(hf_config, rope),
            local_rope_theta=None if local_rope is None else float(local_rope.get("rope_theta", 10000.0)),
            local_rope_scaling={} if local_rope is None else _without_theta(local_rope),
            hidden_act=_hidden_act(hf_config),
            fused_checkpoint=arch.fused_checkpoint,
            moe=None if arch.moe is None else MoeSpec.from_hf_config(hf_config, arch.moe),
            mla=MlaSpec.from_hf_config(hf_config) if arch.mla else None,
            attention_sinks=arch.attention_sinks,
            quantization=None if dequantize else quantization,
            dequantize_fp8_blocks=dequantize,
            block_fp8=quantization if dequantize else None,
            num_labels=int(hf_config.num_labels) if pooling is not None and pooling.kind == "classify" else 0,
            bidirectional=getattr(hf_config, "is_causal", True) is False,
            **(_gemma_fields(hf_config) if arch.gemma else {}),
        )

    @classmethod
    def _vision_language(cls, hf_config, architecture: str) -> ModelSpec:
        """The language model from the config's text part, the image side beside it."""
        import dataclasses

        text = hf_config.get_text_config()
        text.architectures = [_BY_MODEL_TYPE.get(text.model_type, "Qwen2ForCausalLM")]
        if getattr(text, "tie_word_embeddings", None) is None or hasattr(hf_config, "tie_word_embeddings"):
            text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        language = cls.from_hf_config(text)
        rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
        vision = VisionSpec.from_hf_config(hf_config, VISION_ARCHITECTURES[architecture], rope)
        return dataclasses.replace(
            language,
            architecture=architecture,
            model_type=hf_config.model_type,
            checkpoint_dtype=_checkpoint_dtype(hf_config) or language.checkpoint_dtype,
            vision=vision,
        )

    @classmethod
    def _encoder(cls, hf_config, architecture: str) -> ModelSpec:
        """BERT and XLM-RoBERTa: post-LayerNorm encoder layers, GELU MLP, learned positions."""
        act = getattr(hf_config, "hidden_act", "gelu")
        if act not in ENCODER_ACTIVATIONS:
            raise ValueError(f"model: hidden_act {act!r} is not supported for encoders {ENCODER_ACTIVATIONS}")
        if getattr(hf_config, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise ValueError("model: only absolute position embeddings are supported for encoders")
        offset = (hf_config.pad_token_id + 1) if POOLING_REGISTRY[architecture].family == "xlm-roberta" else 0
        num_heads = hf_config.num_attention_heads
        return cls(
            architecture=architecture,
            model_type=hf_config.model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=hf_config.hidden_size // num_heads,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=float(hf_config.layer_norm_eps),
            rope_theta=0.0,
            max_position_embeddings=hf_config.max_position_embeddings - offset,
            tie_word_embeddings=False,
            checkpoint_dtype=_checkpoint_dtype(hf_config),
            hidden_act=act,
            encoder=True,
            type_vocab_size=int(getattr(hf_config, "type_vocab_size", 0) or 0),
            position_offset=offset,
            num_labels=int(getattr(hf_config, "num_labels", 0) or 0) if "Classification" in architecture else 0,
        )

    @classmethod
    def _modernbert(cls, hf_config, architecture: str) -> ModelSpec:
        """ModernBERT: pre-norm layers, GeGLU MLP, rotary positions (a theta for the global
        layers, another for the sliding ones), every global_attn_every_n_layers-th layer global."""
        for key in ("hidden_activation", "classifier_activation"):
            act = getattr(hf_config, key, "gelu")
            if act not in ENCODER_ACTIVATIONS:
                raise ValueError(f"model: {key} {act!r} is not supported for encoders {ENCODER_ACTIVATIONS}")
        pooling = getattr(hf_config, "classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"model: classifier_pooling {pooling!r} is not supported (cls, mean)")
        rope, local_rope = _modernbert_rope(hf_config)
        num_heads, attention_bias = hf_config.num_attention_heads, bool(hf_config.attention_bias)
        classify = POOLING_REGISTRY[architecture].kind == "classify"
        return cls(
            architecture=architecture,
            model_type=hf_config.model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_heads,
            head_dim=hf_config.hidden_size // num_heads,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=float(hf_config.norm_eps),
            rope_theta=float(rope["rope_theta"]),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=False,
            qkv_bias=attention_bias,
            o_proj_bias=attention_bias,
            mlp_bias=bool(hf_config.mlp_bias),
            sliding_window=int(hf_config.local_attention) // 2 + 1,
            sliding_layers=_modernbert_local_layers(hf_config),
            checkpoint_dtype=_checkpoint_dtype(hf_config),
            rope_scaling=_without_theta(rope),
            local_rope_theta=float(local_rope["rope_theta"]),
            local_rope_scaling=_without_theta(local_rope),
            hidden_act="gelu",
            encoder=True,
            num_labels=int(hf_config.num_labels) if classify else 0,
            norm_bias=bool(hf_config.norm_bias),
            classifier_bias=bool(getattr(hf_config, "classifier_bias", False)),
            classifier_pooling=pooling,
        )

    @property
    def pooling(self) -> PoolingArchitecture | None:
        """The pooling architecture, None for a decoder served for generation."""
        return POOLING_REGISTRY.get(self.architecture)

    def linear_weights_per_token(self) -> int:
        """Weights of the linear layers one token passes through: the attention projections and
        the gated MLP, or the routed and shared experts it is sent to (not the embeddings or the
        LM head, which a prefill token skips). A prefill token costs about twice this in FLOPs."""
        moe_layers = set(self.moe.layers) if self.moe is not None else set()
        total = 0
        for layer in range(self.num_layers):
            total += self._attention_weights()
            if layer in moe_layers:
                experts = self.moe.top_k * self.moe.intermediate_size + self.moe.shared_expert_intermediate_size
                total += 3 * self.hidden_size * experts
            else:
                total += 3 * self.hidden_size * self.intermediate_size
        return total

    def _attention_weights(self) -> int:
        hidden = self.hidden_size
        if self.mla is not None:
            mla = self.mla
            q_out = self.num_heads * mla.qk_head_dim
            q = hidden * q_out if mla.q_lora_rank is None else mla.q_lora_rank * (hidden + q_out)
            kv = hidden * mla.latent_dim + mla.kv_lora_rank * self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            return q + kv + self.num_heads * mla.v_head_dim * hidden
        q = self.num_heads * self.head_dim
        return hidden * (q + 2 * self.num_kv_heads * self.head_dim) + q * hidden

    @classmethod
    def from_pretrained(cls, model_dir: str) -> ModelSpec:
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(model_dir))

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rotary rotates (HF: int(head_dim * partial_rotary_factor));
        MLA's qk_rope_head_dim."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None where it attends to its whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    def uses_local_rope(self, layer: int) -> bool:
        """Whether the layer rotates by the sliding layers' own rotary (Gemma 3's local layers)."""
        return self.local_rope_theta is not None and layer in self.sliding_layers


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """DeepSeek's multi-head latent attention (HF DeepseekV2Attention / DeepseekV3Attention).

    Each token's keys and values are one compressed latent: kv_lora_rank values (normed, shared
    by every head) and one qk_rope_head_dim rotary key (shared too). kv_b_proj expands the latent
    into each head's qk_nope_head_dim key and v_head_dim value. The cache holds the latent and the
    rotated key: kv_lora_rank + qk_rope_head_dim values per token per layer."""

    q_lora_rank: int | None  # None (V2-Lite): q_proj; else q_a_proj, q_a_layernorm, q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2
    # The rotary dims pair up as (x0, x1), (x2, x3), ... (V2 always, V3's rope_interleave), rather
    # than as the two halves.
    rope_interleave: bool = True

    @classmethod
    def from_hf_config(cls, hf_config) -> MlaSpec:
        nope, rope = int(hf_config.qk_nope_head_dim), int(hf_config.qk_rope_head_dim)
        q_lora = getattr(hf_config, "q_lora_rank", None)
        return cls(
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(hf_config.kv_lora_rank),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(hf_config.v_head_dim),
            softmax_scale=_mla_softmax_scale((nope + rope) ** -0.5, _rope_parameters(hf_config)[0]),
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the cache: the latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context extended `factor` times (HF's get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _mla_softmax_scale(scale: float, rope: dict[str, Any]) -> float:
    """HF's yarn_apply_mscale: a scaled rotary with mscale_all_dim multiplies the softmax scale by
    mscale(factor, mscale_all_dim) squared."""
    mscale_all_dim = rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", "default") != "default" and mscale_all_dim:
        m = yarn_mscale(rope["factor"], mscale_all_dim)
        scale = scale * m * m
    return scale


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The experts of an MoE model. Routing as transformers does it: softmax over all experts in
    fp32, the top k, renormalized if `renormalize`; layers outside `layers` keep a dense MLP of
    the config's `intermediate_size`."""

    format: MoeFormat
    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    shared_expert_intermediate_size: int  # 0: no shared expert (Qwen2-MoE has one, with a sigmoid gate)
    renormalize: bool
    layers: tuple[int, ...]
    # How experts are picked (zllm/workers/layers.py grouped_route): "softmax" (Mixtral, Qwen: the
    # top k of a softmax over all), DeepSeek-V2's "greedy" and "group_limited_greedy" (the top k of
    # the softmax within the topk_group groups of n_group whose best expert scores highest), V3's
    # "noaux_tc" (sigmoid scores; groups ranked by their two best scores plus the correction bias,
    # which picks but does not weigh). DeepSeek's weights are then times routed_scaling_factor.
    # GPT-OSS's "topk_softmax": the top k of the router's logits (it has a bias), softmaxed.
    routing: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate; DeepSeek's shared experts are ungated
    # GPT-OSS: the clamped SwiGLU's alpha and limit; experts stored as MXFP4 blocks and scales.
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    mxfp4: bool = False

    @classmethod
    def from_hf_config(cls, hf_config, fmt: MoeFormat) -> MoeSpec:
        num_experts = int(getattr(hf_config, fmt.num_experts_key))
        num_layers = hf_config.num_hidden_layers
        layers = tuple(range(num_layers))
        if fmt.deepseek:
            return cls._deepseek(hf_config, fmt, num_experts)
        if fmt.gpt_oss:
            return cls(
                format=fmt,
                num_experts=num_experts,
                top_k=int(hf_config.num_experts_per_tok),
                intermediate_size=int(getattr(hf_config, fmt.intermediate_key)),
                shared_expert_intermediate_size=0,
                renormalize=True,  # a softmax over the k chosen logits
                layers=layers,
                routing="topk_softmax",
                swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
                swiglu_limit=float(getattr(hf_config, "swiglu_limit", 7.0)),
                mxfp4=_quant_method(hf_config) == "mxfp4",
            )
        if fmt.sparse_layer_keys:
            step = getattr(hf_config, "decoder_sparse_step", 1) or 1
            dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
            layers = tuple(i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        top_k = int(hf_config.num_experts_per_tok)
        if layers and not 0 < top_k <= num_experts:
            raise ValueError(f"model: num_experts_per_tok {top_k} must be in 1..{num_experts} (the number of experts)")
        return cls(
            format=fmt,
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=int(getattr(hf_config, fmt.intermediate_key)),
            shared_expert_intermediate_size=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
            renormalize=fmt.always_renormalize or bool(getattr(hf_config, "norm_topk_prob", False)),
            layers=layers,
        )

    @classmethod
    def _deepseek(cls, hf_config, fmt: MoeFormat, num_experts: int) -> MoeSpec:
        """DeepSeek-V2/V3: MoE from layer first_k_dense_replace on; V2's topk_method (V3 has none:
        always noaux_tc); V2 never renormalizes, V3 per norm_topk_prob."""
        v3 = hf_config.model_type == "deepseek_v3"
        routing = "noaux_tc" if v3 else (getattr(hf_config, "topk_method", None) or "greedy")
        if routing not in ("greedy", "group_limited_greedy", "noaux_tc") or (routing == "noaux_tc") != v3:
            raise ValueError(f"model: topk_method {routing!r} is not supported (greedy, group_limited_greedy)")
        grouped = routing != "greedy"
        n_group = int(hf_config.n_group or 1) if grouped else 1
        topk_group = int(hf_config.topk_group or 1) if grouped else 1
        if grouped and (num_experts % n_group or not 0 < topk_group <= n_group):
            raise ValueError(
                f"model: {num_experts} experts cannot form n_group {n_group} groups with topk_group {topk_group}"
            )
        top_k = int(hf_config.num_experts_per_tok)
        first_dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
        return cls(
            format=fmt,
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=int(getattr(hf_config, fmt.intermediate_key)),
            shared_expert_intermediate_size=int(hf_config.moe_intermediate_size)
            * int(getattr(hf_config, "n_shared_experts", 0) or 0),
            renormalize=v3 and bool(getattr(hf_config, "norm_topk_prob", False)),
            layers=tuple(range(first_dense, hf_config.num_hidden_layers)),
            routing=routing,
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
            shared_expert_gated=False,
        )


def _quant_method(hf_config) -> str | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return config.get("quant_method")


def _dequantized_fp8_blocks(quantization: QuantSpec | None, arch: Architecture) -> bool:
    """A quant_method fp8 checkpoint (128x128 block scales, `weight_scale_inv`) of a model
    whose layers cannot hold FP8 weights: the MoE experts (the fused MoE kernels take the model
    dtype) and MLA's kv_b_proj (its absorbed decode multiplies by the matrix itself). DeepSeek-V3's
    release is one; it is dequantized at load (zllm/workers/weight_loader.py)."""
    return (
        quantization is not None
        and quantization.source == "fp8"
        and quantization.block
        and (arch.moe is not None or arch.mla)
    )


def _mxfp4_experts(hf_config, arch: Architecture) -> bool:
    """GPT-OSS's MXFP4 checkpoints quantize the experts only (modules_to_not_convert names the
    rest), which the MoE block reads itself: the linear layers stay unquantized."""
    return arch.moe is not None and arch.moe.gpt_oss and _quant_method(hf_config) == "mxfp4"


def pick_architecture(hf_config) -> str:
    """The first of the config's `architectures` that zllm implements (as vLLM picks)."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _BY_MODEL_TYPE:
        names = [_BY_MODEL_TYPE[hf_config.model_type]]
    for name in names:
        if name in MODEL_REGISTRY or name in POOLING_REGISTRY:
            return name
    raise unsupported_architecture(names or f"none (model_type {getattr(hf_config, 'model_type', None)!r})")


def unsupported_architecture(found) -> ValueError:
    return ValueError(
        f"model: architecture {found} is not supported; supported architectures: "
        f"{', '.join(sorted([*MODEL_REGISTRY, *POOLING_REGISTRY]))}"
    )


def _sliding_layers(hf_config) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that use it); (None, ()) when every layer attends to all.

    Mistral and Phi-3 set `sliding_window` for every layer (null in Mistral v0.2 and later);
    Gemma 2/3 and Qwen2/3 (only with `use_sliding_window`) use it in the layers `layer_types`
    marks "sliding_attention".
    """
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None, ()
    layer_types = getattr(hf_config, "layer_types", None)
    num_layers = hf_config.num_hidden_layers
    if layer_types is None:
        layers = tuple(range(num_layers))
    else:
        layers = tuple(i for i, kind in enumerate(layer_types[:num_layers]) if kind == "sliding_attention")
    return (int(window), layers) if layers else (None, ())


def _hidden_act(hf_config) -> str:
    """The MLP's activation: Gemma names it `hidden_activation`, the others `hidden_act`."""
    act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"model: hidden_act {act!r} is not supported {SUPPORTED_ACTIVATIONS}")
    return act


def _gemma_fields(hf_config) -> dict[str, Any]:
    """Gemma 2/3's variations, read from their config (absent keys keep HF's defaults)."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("model: use_bidirectional_attention (Gemma embedding models) is not supported")
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    return dict(
        norm_unit_offset=True,
        sandwich_norms=True,
        embed_scale=hf_config.hidden_size**0.5,
        attention_scale=None if scalar is None else float(scalar) ** -0.5,
        attn_logit_softcap=_positive_or_none(getattr(hf_config, "attn_logit_softcapping", None)),
        final_logit_softcap=_positive_or_none(getattr(hf_config, "final_logit_softcapping", None)),
    )


def _positive_or_none(value) -> float | None:
    return float(value) if value else None


def _checkpoint_dtype(hf_config) -> str | None:
    """The config's dtype as a name ("bfloat16"); transformers 5 calls it `dtype`, 4.x `torch_dtype`."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _rope_parameters(hf_config) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the rotary parameters, the sliding layers' own or None), each with `rope_theta` and a
    checked `rope_type`.

    transformers >= 5 keeps them in `rope_parameters`, keyed by layer type where the kinds of
    layer differ (Gemma 3: "full_attention", "sliding_attention"); 4.x in rope_theta/rope_scaling
    (and Gemma 3's rope_local_base_freq).
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    local = None
    if "full_attention" in params:
        local = params.get("sliding_attention")
        params = dict(params["full_attention"] or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    if local is None and getattr(hf_config, "rope_local_base_freq", None) is not None:
        local = {"rope_theta": hf_config.rope_local_base_freq}
    params = _checked_rope(params, hf_config)
    return params, None if local is None else _checked_rope(dict(local), hf_config)


def _modernbert_rope(hf_config) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the global layers' rotary, the sliding layers'): transformers >= 5 keeps them in
    rope_parameters by layer type, 4.x as global_rope_theta and local_rope_theta."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = {"rope_theta": getattr(hf_config, "global_rope_theta", 160000.0)}
        local = {"rope_theta": getattr(hf_config, "local_rope_theta", None) or 10000.0}
    return _checked_rope(full, hf_config), _checked_rope(local, hf_config)


def _modernbert_local_layers(hf_config) -> tuple[int, ...]:
    """The sliding-window layers: `layer_types` (transformers >= 5), else every layer but each
    global_attn_every_n_layers-th (4.x's config, and HF's rule for building layer_types)."""
    num_layers = hf_config.num_hidden_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return tuple(i for i, kind in enumerate(layer_types[:num_layers]) if kind == "sliding_attention")
    every = int(getattr(hf_config, "global_attn_every_n_layers", 3))
    return tuple(i for i in range(num_layers) if i % every)


def _checked_rope(params: dict[str, Any], hf_config) -> dict[str, Any]:
    legacy = params.pop("type", None)  # transformers 4.x's name
    params.setdefault("rope_type", legacy or "default")
    if params["rope_type"] == "mrope":  # Qwen2-VL's multimodal rotary: default frequencies, 3 position streams
        params["rope_type"] = "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"model: rope_type {params['rope_type']!r} is not supported {SUPPORTED_ROPE_TYPES}")
    if params["rope_type"] == "longrope":  # transformers 4.x keeps the pretrained length on the config
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None
        )
        if not original:
            raise ValueError("model: rope_type 'longrope' needs original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(original)
    if params["rope_type"] == "yarn":  # HF's default: the context the model was trained at
        original = params.get("original_max_position_embeddings") or hf_config.max_position_embeddings
        params["original_max_position_embeddings"] = int(original)
    return params


def _without_theta(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}


def _partial_rotary_factor(hf_config, rope: dict[str, Any]) -> float:
    """transformers 5 keeps it in rope_parameters, 4.x on the config."""
    factor = rope.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return float(factor)
