"""A generative decoder converted to a classifier on a GPU (skipped without one): Qwen3-Reranker's
from_2_way_softmax head (made from LM-head rows while loading, tied embeddings as the real 0.6B
has them) in fp32 and bf16 against transformers' fp32 CausalLM, P(yes) = softmax over (no, yes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.models import save_tiny_model
from zllm import LLM

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 200, 3], list(range(3, 90)), list(range(100, 141)), [9], [3 + i % 250 for i in range(393)]]
NO, YES = 7, 42
RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": [f"t{NO}", f"t{YES}"],
    "is_original_qwen3_reranker": True,
}


def test_qwen3_reranker_on_the_gpu_equals_its_causal_lm(tmp_path):
    """fp32 equals transformers' fp32; bf16 stays as close to it as transformers' own bf16 does."""
    import transformers

    model_dir = save_tiny_model(tmp_path / "reranker", "qwen3", head_dim=64, hidden_size=256, tie_word_embeddings=True)

    def hf_probability(dtype: torch.dtype) -> np.ndarray:
        hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().cuda()
        with torch.inference_mode():
            logits = [hf(torch.tensor([p], device="cuda")).logits[0, -1, [NO, YES]].float() for p in PROMPTS]
        return torch.softmax(torch.stack(logits), -1)[:, 1].cpu().numpy()

    def our_probability(dtype: str) -> np.ndarray:
        llm = LLM(str(model_dir), dtype=dtype, hf_overrides=RERANKER, max_num_batched_tokens=512)
        try:
            return np.array([o.outputs.probs[0] for o in llm.classify([{"prompt_token_ids": p} for p in PROMPTS])])
        finally:
            llm.shutdown()

    reference = hf_probability(torch.float32)
    assert np.abs(our_probability("float32") - reference).max() < 1e-5
    hf_bf16_error = np.abs(hf_probability(torch.bfloat16) - reference).max()
    assert np.abs(our_probability("bfloat16") - reference).max() <= max(1.5 * hf_bf16_error, 1e-3)
