"""Vision-language models (Qwen2-VL, Qwen2.5-VL, LLaVA with a CLIP or a SigLIP tower): tiny random checkpoints made by transformers,
generated pictures of different sizes and aspect ratios through the model's own image processor;
the engine's greedy tokens equal transformers' generate on the same processor output (fp32) at
tp 1 and 2, with several images in a prompt and prefill chunks that cut through image tokens; the
encoder cache and the prefix cache keyed by the image."""

from __future__ import annotations

import pytest

from tests.helpers.vision import IMAGE_PAD, LLAVA_PLACEHOLDER, PLACEHOLDER, HFReference, picture, save_tiny_vlm
from zllm import LLM, SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Landscape, portrait, square, wide: 4 to 48 image tokens each.
PICTURES = {"landscape": (120, 90, 0), "portrait": (60, 200, 1), "square": (90, 90, 2), "wide": (300, 70, 3)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (checkpoint directory, its transformers reference)."""
    made = {}
    for kind in ("qwen2_vl", "qwen2_5_vl", "llava", "llava_siglip"):
        directory = save_tiny_vlm(tmp_path_factory.mktemp(kind), kind)
        made[kind] = (directory, HFReference(directory))
    return made


@pytest.fixture(scope="module")
def expected(models):
    """kind -> transformers' (prompt ids, greedy tokens) of each of _cases()."""
    return {
        kind: [ref.greedy(text, images, MAX_TOKENS) for text, images in _cases(kind)]
        for kind, (_, ref) in models.items()
    }


def _cases(kind: str = "qwen2_vl") -> list[tuple[str, list]]:
    """(prompt text, its pictures): one image each, then two in one prompt."""
    images = {name: picture(*args) for name, args in PICTURES.items()}
    image = LLAVA_PLACEHOLDER if kind.startswith("llava") else PLACEHOLDER
    return [
        (f"t5 t6 {image} t7 t8", [images["landscape"]]),
        (f"t9 {image} t10 t11 t12", [images["portrait"]]),
        (f"t3 {image} t4 t5 {image} t6", [images["wide"], images["square"]]),
    ]


def _generate(llm: LLM, cases) -> list[tuple[list[int], list[int]]]:
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases]
    return [(out.prompt_token_ids, out.outputs[0].token_ids) for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    ("kind", "tp", "max_num_batched_tokens"),
    [
        ("qwen2_vl", 1, None),
        ("qwen2_5_vl", 1, 7),  # 7-token chunks: every image is cut, several times
        ("qwen2_vl", 2, 7),
        ("qwen2_5_vl", 2, None),
        ("llava", 1, 7),
        ("llava", 2, None),
        ("llava_siglip", 1, 7),
        ("llava_siglip", 2, None),
    ],
)
def test_greedy_tokens_equal_transformers(models, expected, kind, tp, max_num_batched_tokens):
    chunking = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    with LLM(str(models[kind][0]), dtype="float32", tensor_parallel_size=tp, **chunking) as llm:
        assert _generate(llm, _cases(kind)) == expected[kind]


def test_every_vision_architecture_is_tested(models):
    from zllm.model_spec import VISION_ARCHITECTURES

    assert set(VISION_ARCHITECTURES.values()) == {kind.removesuffix("_siglip") for kind in models}


def test_different_images_differ_and_never_share_prefix_blocks(models):
    """Two pictures of one size (so equal token ids) in one text: different outputs, each
    transformers' own, though the second request finds the first's blocks in the prefix cache
    if the image were not part of their hashes."""
    directory, reference = models["qwen2_vl"]
    text = f"t5 t6 {PLACEHOLDER} t7 t8"
    first, second = [picture(120, 90, seed) for seed in (0, 5)]
    with LLM(str(directory), dtype="float32") as llm:
        outputs = [_generate(llm, [(text, [image])])[0] for image in (first, second, first)]
        stats = llm.engine.core.stats()
    expected = [reference.greedy(text, [image], MAX_TOKENS) for image in (first, second)]
    assert outputs == [expected[0], expected[1], expected[0]]
    assert expected[0][1] != expected[1][1]
    assert stats.prefix_cache_hits > 0  # the third found the first's blocks, images and all


def test_encoder_cache_hit_on_a_repeated_image(models):
    """The same picture at another place in another prompt (so no prefix-cache block covers
    it) is not encoded again: the encoder cache's hit is counted."""
    directory, reference = models["qwen2_5_vl"]
    image = picture(*PICTURES["square"])
    cases = [(f"t5 t6 {PLACEHOLDER} t7", [image]), (f"t9 t10 t11 {PLACEHOLDER} t12", [image])]
    with LLM(str(directory), dtype="float32") as llm:
        outputs = [_generate(llm, [case])[0] for case in cases]
        stats = llm.engine.core.stats()
    assert outputs == [reference.greedy(text, images, MAX_TOKENS) for text, images in cases]
    assert (stats.encoder_cache_queries, stats.encoder_cache_hits) == (2, 1)


def test_preempted_requests_resume_from_the_encoder_cache(models, expected):
    """A KV cache too small for the batch preempts requests mid-prefill; resumed, they read their
    images from the encoder cache (prefix caching off, so they recompute every token)."""
    directory = models["qwen2_vl"][0]
    with LLM(
        str(directory),
        dtype="float32",
        block_size=8,
        num_kv_blocks=8,  # 64 tokens for 104 tokens of prompts and outputs: must preempt
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    ) as llm:
        outputs = _generate(llm, _cases())
        stats = llm.engine.core.stats()
    assert outputs == expected["qwen2_vl"]
    assert stats.num_preemptions > 0
    assert stats.encoder_cache_hits > 0


def test_processor_kwargs_limits_and_refusals(models):
    """--mm-processor-kwargs reach the image processor (a prompt's own override them), more
    images than --limit-mm-per-prompt or than placeholders are refused, naming the field."""
    directory = models["qwen2_vl"][0]
    image = picture(*PICTURES["wide"])
    text = f"t5 {PLACEHOLDER} t6"
    with LLM(
        str(directory),
        dtype="float32",
        limit_mm_per_prompt={"image": 1},
        mm_processor_kwargs={"max_pixels": 28 * 28 * 4},
    ) as llm:
        small = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
        larger = llm.generate(
            {"prompt": text, "multi_modal_data": {"image": image}, "mm_processor_kwargs": {"max_pixels": 28 * 28 * 16}},
            GREEDY,
            use_tqdm=False,
        )
        assert small[0].prompt_token_ids.count(IMAGE_PAD) == 4
        assert 4 < larger[0].prompt_token_ids.count(IMAGE_PAD) <= 16
        with pytest.raises(ValueError, match="more than the 1 a prompt may carry"):
            llm.generate({"prompt": text + f" {PLACEHOLDER}", "multi_modal_data": {"image": [image, image]}}, GREEDY)
        with pytest.raises(ValueError, match="1 image.* but the prompt has 0 image placeholder"):
            llm.generate({"prompt": "t5 t6", "multi_modal_data": {"image": image}}, GREEDY)
        with pytest.raises(ValueError, match="must be a PIL image"):
            llm.generate({"prompt": text, "multi_modal_data": {"image": "picture.png"}}, GREEDY)
        # The engine goes on.
        again = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
        assert again[0].outputs[0].token_ids == small[0].outputs[0].token_ids


@pytest.mark.parametrize("tower", ["clip", "siglip"])
@pytest.mark.parametrize("select", ["default", "full"])
def test_llava_image_tokens_equal_transformers_features(tower, select):
    """Each placeholder becomes as many tokens as transformers' LLaVA makes features of the image:
    CLIP's class token counts, SigLIP has none, and "default" drops the first position of either."""
    import torch
    import transformers

    from zllm.model_spec import ModelSpec

    shape = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14
    )
    vision = transformers.SiglipVisionConfig(**shape) if tower == "siglip" else transformers.CLIPVisionConfig(**shape)
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
        ),
        vision_feature_select_strategy=select,
        architectures=["LlavaForConditionalGeneration"],
    )
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.inference_mode():
        features = model.get_image_features(
            pixel_values=torch.zeros(1, 3, 56, 56),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=select,
        ).pooler_output[0]
    spec = ModelSpec.from_hf_config(config).vision
    assert spec.tower == tower
    assert spec.tokens_of([1, 4, 4]) == features.shape[0]
