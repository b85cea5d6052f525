"""The model's tokenizer, EOS ids and chat template, all from transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Messages = list[dict[str, Any]]


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"tokenizer: {path} has no fast (tokenizers) backend; zllm needs one for streaming")
    return tokenizer


def eos_token_ids(model_dir: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The generation config's EOS ids (what HF generate stops on) plus the tokenizer's."""
    ids: set[int] = set()
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
) -> str:
    """Render a conversation to the prompt text the model was trained on."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages: must be a list of {'role': ..., 'content': ...} dicts")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("messages: this model's tokenizer has no chat template; pass chat_template=")
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
    )
