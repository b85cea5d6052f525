"""Vision-language models on a GPU (skipped without one): tiny random Qwen2.5-VL and LLaVA (CLIP
and SigLIP towers) made by transformers, with heads the csrc kernels take (head_dim 64), against
transformers on the same GPU. fp32 must give transformers' greedy tokens exactly; bf16 (decode
CUDA graphs, async scheduling, prefill chunks cutting through images) must give the same tokens as
bf16 eager synchronous steps, and agree with fp32 on most positions. The memory profile's peak
with its dummy images covers the peak of real steps with the largest images."""

from __future__ import annotations

import pytest

from tests.helpers.gpu import record, share_identical
from tests.helpers.vision import LLAVA_PLACEHOLDER, PLACEHOLDER, HFReference, picture, save_tiny_vlm
from zllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)


def _cases(kind: str) -> list[tuple[str, list]]:
    image = LLAVA_PLACEHOLDER if kind.startswith("llava") else PLACEHOLDER
    return [
        (f"t5 t6 {image} t7 t8", [picture(120, 90, 0)]),
        (f"t9 {image} t10 t11 t12", [picture(60, 200, 1)]),
        (f"t3 {image} t4 t5 {image} t6", [picture(300, 70, 3), picture(90, 90, 2)]),
        (" ".join(f"t{i}" for i in range(3, 120)) + f" {image} t4", [picture(200, 200, 4)]),
    ]


def _engine(model_dir, kind: str, **engine_args) -> list[tuple[list[int], list[int]]]:
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in _cases(kind)]
    with LLM(str(model_dir), **engine_args) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "llava", "llava_siglip"])
def test_fp32_on_the_gpu_equals_transformers(tmp_path, kind):
    model_dir = save_tiny_vlm(tmp_path / kind, kind, **WIDE)
    reference = HFReference(model_dir, device="cuda")
    expected = [reference.greedy(text, images, MAX_TOKENS) for text, images in _cases(kind)]
    assert _engine(model_dir, kind, dtype="float32", max_num_batched_tokens=64) == expected


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "llava", "llava_siglip"])
def test_bf16_graphs_and_async_steps_equal_eager_steps(tmp_path, kind):
    model_dir = save_tiny_vlm(tmp_path / kind, kind, **WIDE)
    fast = _engine(model_dir, kind, dtype="bfloat16", max_num_batched_tokens=64)
    eager = _engine(
        model_dir, kind, dtype="bfloat16", max_num_batched_tokens=64, enforce_eager=True, async_scheduling=False
    )
    exact = _engine(model_dir, kind, dtype="float32", max_num_batched_tokens=64)
    assert fast == eager
    agreement = share_identical([t for _, t in fast], [t for _, t in exact])
    record(f"vision_{kind}_bf16_vs_fp32_agreement", round(agreement, 3))
    assert agreement >= 0.5


def _largest_image_steps(runner, config, plan) -> tuple[list, int]:
    """Steps as the engine core could schedule them: plan.count largest images (pictures the
    model's processor turns into plan.tokens tokens each), --limit-mm-per-prompt of them a request
    (one where unlimited), each followed by a text token; as many requests a step as the token
    budget holds (a first chunk alone where one is larger), each image encoded in the step whose
    chunk reaches it. None finishes: the encoder cache ends full. (steps, KV blocks they need)"""
    from tests.helpers.vision import IMAGE_PAD
    from zllm.frontend.multimodal import ImageProcessor
    from zllm.ipc.messages import NewRequestData, StepInput

    processor = ImageProcessor(config.model, runner.spec.vision, config.mm_processor_kwargs)
    each = config.limit_mm_per_prompt.get("image", 1)
    budget = config.max_num_batched_tokens
    length = each * (plan.tokens + 1)
    scheduled = min(length, budget)
    per_step = max(1, budget // length)
    blocks_each = -(-scheduled // config.block_size)
    steps, step = [], None
    for index in range(plan.count // each):
        # 1000 x 1000 pixels: past Qwen's max_pixels here; LLaVA's processor resizes any picture.
        pictures = [picture(1000, 1000, 100 + index * each + i) for i in range(each)]
        prompt, images = processor.expand([IMAGE_PAD, 5] * each, pictures)
        for image in images:
            assert image.length == plan.tokens and tuple(image.pixel_values.shape) == plan.pixel_shape
        if index % per_step == 0:
            step = StepInput(
                step_id=len(steps), new_requests=[], cached_requests=[], scheduled_ids=[], num_scheduled_tokens=[]
            )
            steps.append(step)
        request_id = f"r{index}"
        blocks = list(range(index * blocks_each, (index + 1) * blocks_each))
        sampling = SamplingParams(temperature=0.0, max_tokens=1)
        step.new_requests.append(NewRequestData(request_id, len(prompt), prompt, sampling, blocks, 0, mm_inputs=images))
        step.scheduled_ids.append(request_id)
        step.num_scheduled_tokens.append(scheduled)
        step.encode[request_id] = [i for i, image in enumerate(images) if image.offset < scheduled]
    return steps, (plan.count // each) * blocks_each


def _profiled_peak(runner) -> int:
    """What _profile_kv_blocks subtracts for activations: the profile's peak above the weights,
    less its scratch KV cache."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated()
    scratch = runner._profile_forward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - weights - scratch


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava_siglip"])
def test_memory_profile_covers_the_largest_image_batch(tmp_path, kind):
    """The profile's activation peak with its dummy images is at least the peak of real steps
    whose requests carry the largest images the processor makes until the encoder cache is full
    (each encoded in a step with a forward at the token budget); the text-only profile falls short
    of it where images are large, so they are what covers it. Qwen: the checkpoint's processor
    lets 1024-token images in (16 fill the cache); LLaVA-SigLIP: 16-token images, 8 prompts of at most
    4 (32 images: too small to tell from the text forward, checked for the profile's bound only)."""
    import torch
    import transformers

    from zllm.config import EngineConfig
    from zllm.workers.model_runner import ModelRunner
    from zllm.workers.multimodal import ProfileImages

    model_dir = save_tiny_vlm(tmp_path / kind, kind, max_position_embeddings=4096, **WIDE)
    limits = dict(limit_mm_per_prompt={"image": 4}, max_num_seqs=8)
    if kind == "qwen2_vl":  # the checkpoint's processor lets 1024-token images in
        processor = transformers.Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 1024)
        processor.save_pretrained(model_dir)
        limits = {}
    config = EngineConfig.create(
        str(model_dir), device="cuda", dtype="bfloat16", max_num_batched_tokens=256, enforce_eager=True, **limits
    )
    runner = ModelRunner(config, torch.device("cuda"))
    runner.load_model()
    plan = ProfileImages.plan(runner.spec.vision, config)
    assert (plan.tokens, plan.count) == ((1024, 16) if kind == "qwen2_vl" else (16, 32))

    _profiled_peak(runner)  # warm-up: cuBLAS's workspace and other first-use allocations stay allocated
    mm, runner.mm = runner.mm, None
    text_only = _profiled_peak(runner)
    runner.mm = mm
    profiled = _profiled_peak(runner)

    steps, num_blocks = _largest_image_steps(runner, config, plan)
    runner.initialize_kv_cache(num_blocks)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # weights, KV cache
    with torch.inference_mode():
        for step in steps:
            runner.execute_step(step)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    assert len(runner.mm.cache) == plan.count
    record(
        f"vision_profile_{kind}_mib",
        {"profiled": profiled / 2**20, "measured": measured / 2**20, "text_only": text_only / 2**20},
    )
    assert profiled >= measured
    if kind == "qwen2_vl":  # 16 MiB of held outputs and 4096-patch encodes: the text-only profile misses them
        assert text_only < measured
