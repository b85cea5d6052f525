"""The memory profile of a vision-language model (zllm/workers/multimodal.py, ProfileImages):
its dummy images have the shape of the largest image the model's own processor makes under
--mm-processor-kwargs (LLaVA: its tower's one size), capped by what the engine core accepts, as
many as the encoder cache and --limit-mm-per-prompt allow; the profile's forward runs with them
encoded and held, and leaves nothing behind. On CPU the KV cache is not sized by the profile, but
ModelRunner._profile_forward runs as on a GPU (tests/gpu/test_vision_gpu.py compares the peaks)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.vision import IMAGE_PAD, picture, save_tiny_vlm
from zllm.config import EngineConfig
from zllm.frontend.multimodal import ImageProcessor
from zllm.model_spec import ModelSpec
from zllm.workers.multimodal import ProfileImages

# Aspect ratios and sizes from tiny to far past any limit, up to 200:1 (Qwen's processor refuses
# more): a thin image keeps its short side at 28 pixels however much it is scaled down.
SIZES = [(40, 40), (90, 90), (300, 70), (60, 200), (1000, 1000), (1600, 1200), (1200, 1600), (5000, 200), (5600, 28)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {kind: save_tiny_vlm(tmp_path_factory.mktemp(kind), kind) for kind in ("qwen2_vl", "llava_siglip")}


def _config(model_dir, **kwargs) -> EngineConfig:
    return EngineConfig.create(str(model_dir), device="cpu", dtype="float32", **kwargs)


def _processed(config: EngineConfig, width: int, height: int):
    """What the frontend makes of a picture: its ImageInput."""
    vision = ModelSpec.from_pretrained(config.model).vision
    _, [image] = ImageProcessor(config.model, vision, config.mm_processor_kwargs).expand(
        [IMAGE_PAD], picture(width, height, 0)
    )
    return image


def _check_largest(config: EngineConfig, plan: ProfileImages) -> None:
    """The largest of the pictures through the processor is the plan's image."""
    largest = max((_processed(config, *size) for size in SIZES), key=lambda image: image.length)
    assert (largest.grid_thw, largest.length, tuple(largest.pixel_values.shape)) == (
        list(plan.grid),
        plan.tokens,
        plan.pixel_shape,
    )


@pytest.mark.parametrize(
    ("processor_kwargs", "tokens"),
    [
        ({}, 97),
        ({"max_pixels": 28 * 28 * 16}, 56),
        ({"size": {"shortest_edge": 3136, "longest_edge": 28 * 28 * 1024}}, 1024),
    ],
)
def test_qwen_largest_image_is_the_processors(checkpoints, processor_kwargs, tokens):
    """The checkpoint's processor's max_pixels is 48 merged tokens, --mm-processor-kwargs set
    another (either spelling); a 200:1 picture gets more than max_pixels allow where they are few
    (1 x 97 for 48, 1 x 56 for 16), the square-ish largest area where they are many (32 x 32);
    as many as the encoder cache holds."""
    config = _config(checkpoints["qwen2_vl"], mm_processor_kwargs=processor_kwargs)
    plan = ProfileImages.plan(ModelSpec.from_pretrained(config.model).vision, config)
    assert plan.tokens == tokens
    assert plan.count == config.encoder_cache_tokens // tokens
    _check_largest(config, plan)


def test_limits_cap_the_count_and_the_size(checkpoints):
    """--limit-mm-per-prompt x max_num_seqs images at most; none above max_model_len tokens (the
    core refuses such a prompt), none at all when images are off."""
    model_dir = checkpoints["qwen2_vl"]
    vision = ModelSpec.from_pretrained(str(model_dir)).vision
    plan = ProfileImages.plan(vision, _config(model_dir, limit_mm_per_prompt={"image": 2}, max_num_seqs=3))
    assert (plan.tokens, plan.count) == (97, 6)
    short = ProfileImages.plan(vision, _config(model_dir, max_model_len=32))
    assert short.tokens == 32 and short.grid[1] * short.grid[2] == 32 * 4
    assert ProfileImages.plan(vision, _config(model_dir, limit_mm_per_prompt={"image": 0})) is None


def test_llava_siglip_largest_image_is_the_towers(checkpoints):
    config = _config(checkpoints["llava_siglip"])
    plan = ProfileImages.plan(ModelSpec.from_pretrained(config.model).vision, config)
    assert (plan.grid, plan.pixel_shape, plan.tokens) == ((1, 4, 4), (3, 56, 56), 16)
    _check_largest(config, plan)


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava_siglip"])
def test_profile_forward_encodes_and_holds_the_images(checkpoints, kind):
    """The tower encodes one dummy image of the plan's shape; the forward runs while the cache
    holds all of them, its tokens taking their embeddings where whole images fit; afterwards the
    cache and the runner's requests are empty."""
    from zllm.workers.model_runner import ModelRunner

    config = _config(checkpoints[kind], limit_mm_per_prompt={"image": 2}, max_num_seqs=3, max_num_batched_tokens=256)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    plan = ProfileImages.plan(runner.spec.vision, config)
    model = runner.model
    encoded, held, placed = [], [], []
    encode, forward = model.encode_image, model.forward

    def spy_encode(pixels, grid):
        encoded.append((tuple(pixels.shape), grid))
        return encode(pixels, grid)

    def spy_forward(*args, **kwargs):
        held.append(sorted(tuple(out.shape) for out in runner.mm.cache.values()))
        mm_embeds = kwargs.get("mm_embeds")
        placed.append(None if mm_embeds is None else mm_embeds[0].tolist())
        return forward(*args, **kwargs)

    model.encode_image, model.forward = spy_encode, spy_forward
    scratch = runner._profile_forward()
    assert scratch > 0
    assert encoded == [(plan.pixel_shape, plan.grid)]
    assert held == [[(plan.tokens, runner.spec.hidden_size)] * plan.count]
    assert plan.count == 6
    # Whole images over the 256 profile tokens take the image-embedding path (2 of 97, 16 of 16).
    assert placed == [list(range(256 // plan.tokens * plan.tokens))]
    assert runner.mm.cache == {} and runner.requests == {} and runner.mm.num_encoded == 0


def test_pixel_limits_reach_the_processor_as_its_size(checkpoints):
    """min_pixels / max_pixels become the processor's `size` edges, the missing one kept from
    the checkpoint (transformers 5.17 ignores a lone max_pixels at call time; `size` is read by
    every release), and the picture gets the grid those edges allow."""
    config = _config(checkpoints["qwen2_vl"])
    vision = ModelSpec.from_pretrained(config.model).vision
    images = ImageProcessor(config.model, vision)
    shortest = images.processor.size["shortest_edge"]
    assert images._pixel_limits_as_size({"max_pixels": 28 * 28 * 8, "other": 1}) == {
        "size": {"shortest_edge": shortest, "longest_edge": 28 * 28 * 8},
        "other": 1,
    }
    assert images._pixel_limits_as_size({"do_resize": True}) == {"do_resize": True}
    _, [limited] = images.expand([IMAGE_PAD], picture(400, 300, 0), {"max_pixels": 28 * 28 * 8})
    assert limited.length <= 8 < _processed(config, 400, 300).length
