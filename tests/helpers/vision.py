"""Tiny random Qwen2-VL / Qwen2.5-VL / LLaVA (CLIP or SigLIP tower) checkpoints made by transformers, beside a word-level
tokenizer with the vision special tokens and the model's own image processor; generated test
pictures; transformers' greedy reference on the same processor output."""

from __future__ import annotations

from pathlib import Path

VOCAB = 256
# The special tokens' ids: the last three of the tiny vocabulary.
VISION_START, IMAGE_PAD, VISION_END = 253, 254, 255
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
LLAVA_PLACEHOLDER = "<image>"
# Each message's content and a space: the text the tests' references tokenize.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
SPECIAL_TOKENS = {  # kind -> the tokens at ids 253, 254, 255
    "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
    "llava": ["<unused_0>", "<image>", "<unused_1>"],
    "llava_siglip": ["<unused_0>", "<image>", "<unused_1>"],
}


def save_tiny_vlm(directory: Path, kind: str = "qwen2_vl", **text_overrides) -> Path:
    """A random model of `kind` ("qwen2_vl", "qwen2_5_vl", "llava" or "llava_siglip"), biases and
    norms randomised too, with a processor that makes 4..48 tokens an image (LLaVA: 56 x 56 pixels,
    16 patches; llava_siglip: a SigLIP tower, its last layer's states of every patch, "full").
    text_overrides: the language model's config (wider heads for the GPU kernels); M-RoPE's
    sections follow its head_dim in Qwen's 2:3:3."""
    import torch
    import transformers

    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    text.update(text_overrides)
    pairs = text["hidden_size"] // text["num_attention_heads"] // 2
    sections = [pairs // 4, pairs * 3 // 8]
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [*sections, pairs - sum(sections)]}
    if kind.startswith("llava"):
        return _save_tiny_llava(directory, text, kind)
    if kind == "qwen2_vl":
        config_class, model_class, processor_class = (
            transformers.Qwen2VLConfig,
            transformers.Qwen2VLForConditionalGeneration,
            transformers.Qwen2VLImageProcessor,
        )
        vision = dict(
            depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=4, mlp_ratio=2, hidden_act="quick_gelu"
        )
    else:
        config_class, model_class, processor_class = (
            transformers.Qwen2_5_VLConfig,
            transformers.Qwen2_5_VLForConditionalGeneration,
            transformers.Qwen2VLImageProcessor,
        )
        # Windows of 4 x 4 merged tokens (112 pixels); block 1 attends to the whole image.
        vision = dict(
            depth=3,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            out_hidden_size=text["hidden_size"],
            window_size=112,
            fullatt_block_indexes=[1],
            hidden_act="silu",
        )
    vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE_PAD,
        video_token_id=VOCAB - 4,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = model_class(config).eval()
    _randomise(model)
    model.save_pretrained(directory, safe_serialization=True)
    _save_tokenizer(directory, kind)
    processor_class(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 48).save_pretrained(directory)
    return directory


def _save_tiny_llava(directory: Path, text: dict, kind: str) -> Path:
    import torch
    import transformers

    text = {k: v for k, v in text.items() if k != "rope_scaling"}
    tower = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56, patch_size=14
    )
    if kind == "llava_siglip":
        # SigLIP: no class token, no pre-norm, gelu_pytorch_tanh; its pooling head stays in the
        # checkpoint (vision_use_head) and unused. LLaVA takes the last layer's states, every patch.
        vision = transformers.SiglipVisionConfig(**tower)
        select = dict(vision_feature_layer=-1, vision_feature_select_strategy="full")
    else:
        vision = transformers.CLIPVisionConfig(**tower)
        select = {}
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=transformers.LlamaConfig(**text, pad_token_id=0),
        image_token_id=IMAGE_PAD,
        tie_word_embeddings=False,
        **select,
    )
    # Seed 1 for SigLIP: with seed 0 its greedy tokens repeat one token whatever the picture.
    torch.manual_seed(1 if kind == "llava_siglip" else 0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _randomise(model)
    model.save_pretrained(directory, safe_serialization=True)
    _save_tokenizer(directory, kind)
    if kind == "llava_siglip":  # resized to the square, no crop
        transformers.SiglipImageProcessor(size={"height": 56, "width": 56}).save_pretrained(directory)
    else:
        transformers.CLIPImageProcessor(
            size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
        ).save_pretrained(directory)
    return directory


def _randomise(model) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif param.dim() >= 2:  # HF's init is small: without this the outputs barely see the image
                param.copy_(torch.randn_like(param) * 0.08)


def _save_tokenizer(directory: Path, kind: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB - 3)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t2", bos_token="t1")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[kind]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)


def picture(width: int, height: int, seed: int):
    """A PIL picture: smooth colour gradients with a few random rectangles (so resizing keeps
    structure and different seeds give visibly different images)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x / width * 255, y / height * 255, (x + y) % 256], axis=-1)
    for _ in range(4):
        x0, y0 = rng.integers(0, width // 2), rng.integers(0, height // 2)
        pixels[y0 : y0 + height // 3, x0 : x0 + width // 3] = rng.integers(0, 256, 3)
    return Image.fromarray(pixels.astype(np.uint8))


class HFReference:
    """transformers' processor and model of a checkpoint, for greedy references."""

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        import torch
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)

    def _llava_tokens(self, size) -> int:
        """LlavaProcessor's count: the patches, the class token (CLIP has one, SigLIP none) and one
        fewer for vision_feature_select_strategy "default" (which drops the first position)."""
        config = self.model.config
        tokens = size[0] * size[1] // config.vision_config.patch_size**2
        tokens += config.vision_config.model_type == "clip_vision_model"
        return tokens - (config.vision_feature_select_strategy == "default")

    def greedy(self, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
        """The processor's output (placeholders expanded) and the model's greedy tokens:
        (prompt token ids, generated ids)."""
        import torch

        ids = self.tokenizer(prompt)["input_ids"]
        kwargs = {}
        if images:
            out = self.processor(images=images, return_tensors="pt")
            if "image_grid_thw" in out:
                counts = (out["image_grid_thw"].prod(-1) // 4).tolist()
            else:  # LLaVA: a token per 14 x 14 patch, as LlavaProcessor counts them
                counts = [self._llava_tokens(out["pixel_values"].shape[-2:])] * len(images)
            expanded = []
            for token in ids:
                expanded.extend([IMAGE_PAD] * counts.pop(0) if token == IMAGE_PAD else [token])
            ids = expanded
            # mm_token_type_ids (1: an image token) is how transformers 5 finds the images for M-RoPE.
            kwargs = dict(pixel_values=out["pixel_values"])
            if "image_grid_thw" in out:
                kwargs.update(
                    image_grid_thw=out["image_grid_thw"],
                    mm_token_type_ids=torch.tensor([[int(t == IMAGE_PAD) for t in ids]]),
                )
        device = self.model.device
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
        with torch.inference_mode():
            generated = self.model.generate(
                torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                **kwargs,
            )
        return ids, generated[0, len(ids) :].tolist()
