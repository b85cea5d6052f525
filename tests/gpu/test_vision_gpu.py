"""Vision-language models on a GPU (skipped without one): tiny random Qwen2.5-VL and LLaVA made
by transformers, with heads the csrc kernels take (head_dim 64), against transformers on the same
GPU. fp32 must give transformers' greedy tokens exactly; bf16 (decode CUDA graphs, async
scheduling, prefill chunks cutting through images) must give the same tokens as bf16 eager
synchronous steps, and agree with fp32 on most positions."""

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
    image = LLAVA_PLACEHOLDER if kind == "llava" else PLACEHOLDER
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


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "llava"])
def test_fp32_on_the_gpu_equals_transformers(tmp_path, kind):
    model_dir = save_tiny_vlm(tmp_path / kind, kind, **WIDE)
    reference = HFReference(model_dir, device="cuda")
    expected = [reference.greedy(text, images, MAX_TOKENS) for text, images in _cases(kind)]
    assert _engine(model_dir, kind, dtype="float32", max_num_batched_tokens=64) == expected


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "llava"])
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
