"""A generative decoder served as a sequence classifier (--runner pooling --convert classify,
vLLM's as_seq_cls_model), fp32 on the CPU against transformers on tiny random checkpoints: the
checkpoint's own `score.weight` against transformers' `*ForSequenceClassification` on the same
weights, and the heads made from LM-head rows (Qwen3-Reranker's from_2_way_softmax, and
no_post_processing) against the softmax of transformers' CausalLM logits over those tokens, at
tp 1 and tp 2; and the conversions the config refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers.models import save_tiny_model
from tests.helpers.pooling import save_tiny_decoder
from zllm import LLM
from zllm.config import EngineConfig

ATOL = 2e-5  # fp32, different summation orders
PROMPTS = [[5, 17, 200, 3], list(range(3, 90)), list(range(100, 141)), [9]]


def _classify(model_dir, tp: int, **engine_args) -> np.ndarray:
    with LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, **engine_args) as llm:
        outputs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    return np.array([o.outputs.probs for o in outputs])


def _causal_lm_with_score_head(directory, config_class: str, family: str, num_labels: int):
    """A `*ForSequenceClassification` checkpoint made by transformers, re-declared as the
    generative `*ForCausalLM` with an lm_head beside its score head (as a fine-tuned LM is)."""
    from safetensors.torch import load_file, save_file

    model_dir = save_tiny_decoder(directory, config_class, f"{family}ForSequenceClassification", num_labels=num_labels)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = [f"{family}ForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn(config["vocab_size"], config["hidden_size"])
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir


@pytest.mark.parametrize(
    "config_class, family, num_labels, tp",
    [("LlamaConfig", "Llama", 3, 1), ("LlamaConfig", "Llama", 3, 2), ("Qwen3Config", "Qwen3", 1, 2)],
)
def test_converted_causal_lm_with_a_score_head_equals_transformers(tmp_path, config_class, family, num_labels, tp):
    import transformers

    model_dir = _causal_lm_with_score_head(tmp_path / "cls", config_class, family, num_labels)
    ours = _classify(model_dir, tp, runner="pooling", convert="classify")
    hf = getattr(transformers, f"{family}ForSequenceClassification").from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = torch.stack([hf.eval()(torch.tensor([p])).logits[0] for p in PROMPTS])
    reference = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, -1)
    assert ours.shape == (len(PROMPTS), num_labels)
    assert np.allclose(ours, reference.numpy(), atol=ATOL)


def _token_probabilities(model_dir, token_ids: list[int]) -> np.ndarray:
    """transformers' CausalLM: the softmax of the last token's logits over `token_ids`."""
    import transformers

    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = torch.stack([hf(torch.tensor([p])).logits[0, -1, token_ids] for p in PROMPTS])
    return torch.softmax(logits, -1).numpy()


@pytest.mark.parametrize("tied, tp", [(False, 1), (True, 2)])
def test_qwen3_reranker_from_2_way_softmax_equals_its_causal_lm(tmp_path, tied, tp):
    """vLLM's Qwen3-Reranker recipe: P(yes) = softmax(logits[no], logits[yes])[yes] as one
    logit (row[yes] - row[no]) and its sigmoid. Qwen3-Reranker-0.6B ties its embeddings."""
    model_dir = save_tiny_model(tmp_path / "reranker", "qwen3", head_dim=16, tie_word_embeddings=tied)
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": ["t7", "t42"],  # the placeholder tokenizer's words ("no", "yes")
        "is_original_qwen3_reranker": True,
    }
    ours = _classify(model_dir, tp, hf_overrides=overrides)
    reference = _token_probabilities(model_dir, [7, 42])[:, 1:]
    assert ours.shape == (len(PROMPTS), 1)
    assert np.allclose(ours, reference, atol=ATOL)


def test_no_post_processing_keeps_each_tokens_row(tmp_path):
    model_dir = save_tiny_model(tmp_path / "lm", "qwen3", head_dim=16)
    overrides = {"classifier_from_token": ["t200", "t3", "t51"], "method": "no_post_processing"}
    ours = _classify(model_dir, 1, runner="pooling", convert="classify", hf_overrides=overrides)
    assert np.allclose(ours, _token_probabilities(model_dir, [200, 3, 51]), atol=ATOL)


def test_conversions_the_config_refuses(tmp_path):
    model_dir = str(save_tiny_model(tmp_path / "lm", "qwen3", head_dim=16))
    with pytest.raises(ValueError, match="convert: classify: the Qwen3ForCausalLM checkpoint has no score.weight"):
        EngineConfig.create(model_dir, runner="pooling", convert="classify")
    reranker = {"architectures": ["Qwen3ForSequenceClassification"], "is_original_qwen3_reranker": True}
    with pytest.raises(ValueError, match="needs classifier_from_token"):
        EngineConfig.create(model_dir, hf_overrides=reranker)
    with pytest.raises(ValueError, match="'nope' is not a token"):
        EngineConfig.create(model_dir, hf_overrides={**reranker, "classifier_from_token": ["t1", "nope"]})
    with pytest.raises(ValueError, match="takes two tokens"):
        EngineConfig.create(model_dir, hf_overrides={**reranker, "classifier_from_token": ["t1", "t2", "t3"]})
    with pytest.raises(ValueError, match="only a pooling class of the checkpoint's own decoder"):
        EngineConfig.create(model_dir, hf_overrides={"architectures": ["LlamaForSequenceClassification"]})
    with pytest.raises(ValueError, match=r"hf_overrides: \['rope_theta'\] not supported"):
        EngineConfig.create(model_dir, hf_overrides={"rope_theta": 1.0})
    with pytest.raises(ValueError, match="hf_overrides: must be a JSON object"):
        EngineConfig.create(model_dir, hf_overrides="x")
    with pytest.raises(ValueError, match="convert: embed contradicts"):
        EngineConfig.create(model_dir, convert="embed", hf_overrides=reranker)
    config = EngineConfig.create(model_dir, hf_overrides={**reranker, "classifier_from_token": ["t7", "t42"]})
    assert (config.runner, config.convert, config.pooler.num_labels) == ("pooling", "classify", 1)
    assert (config.pooler.classifier_token_ids, config.pooler.classifier_method) == ([7, 42], "from_2_way_softmax")
