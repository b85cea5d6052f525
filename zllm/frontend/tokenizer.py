"""The model's tokenizer, EOS ids and chat template, all from transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Messages = list[dict[str, Any]]


# A directory holds a tokenizer when it has one of these (fast, config, SentencePiece, BPE files).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, skip: bool = False) -> PreTrainedTokenizerBase | None:
    """The tokenizer at `path`; None with `skip` (skip_tokenizer_init: token ids in and out).
    A directory without one is refused the same way for every architecture (transformers would
    otherwise fail for some and guess a tokenizer for others)."""
    if skip:
        return None
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer: {path} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); pass --tokenizer DIR, "
            "or --skip-tokenizer-init (LLM(skip_tokenizer_init=True)) to send and receive token ids"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"tokenizer: {path} has no fast (tokenizers) backend; zllm needs one for streaming")
    return tokenizer


def batch_token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of many texts, with the special tokens, as `tokenizer(texts)["input_ids"]` gives
    them. A fast tokenizer's Rust backend is asked directly when nothing would differ (no
    truncation or padding set on it): its `encode_batch_fast` skips the character offsets and
    transformers' per-text conversion, half of the time of a 10,000-sentence embedding batch."""
    backend = getattr(tokenizer, "_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer(texts)["input_ids"]
    return [encoding.ids for encoding in fast(texts, add_special_tokens=True)]


def eos_token_ids(model_dir: str, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """The generation config's EOS ids (what HF generate stops on) plus the tokenizer's."""
    ids: set[int] = set()
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render a conversation (and the tools it may call, as OpenAI's `tools` entries) to the
    prompt text the model was trained on; a template that ignores tools renders without them.
    template_kwargs: extra variables for the template (vLLM's chat_template_kwargs, such as
    Qwen3's `enable_thinking`); they cannot replace the ones set here."""
    _check_messages(messages)
    if tokenizer is None:
        raise ValueError(
            "messages: this engine runs without a tokenizer (skip_tokenizer_init), so without a chat template"
        )
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("messages: this model's tokenizer has no chat template; pass chat_template=")
    extra = _extra_variables(template_kwargs)
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            **extra,
        )
    except Exception as error:  # a template may reject what it does not expect, in any way
        raise ValueError(f"messages: the chat template rejected them: {type(error).__name__}: {error}") from None


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A conversation as a prompt: its rendered text and token ids."""
    text = apply_chat_template(tokenizer, messages, add_generation_prompt, chat_template, tools, template_kwargs)
    # The template already holds the special tokens; don't let the tokenizer add a BOS twice.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


_RESERVED_TEMPLATE_ARGS = ("messages", "conversation", "tools", "add_generation_prompt", "chat_template", "tokenize")


def _extra_variables(template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The caller's template variables, refusing those that would change how we render (a
    `chat_template` could run any Jinja; `tokenize` would change what comes back)."""
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & set(_RESERVED_TEMPLATE_ARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs: may not set {', '.join(reserved)}")
    return template_kwargs


def _check_messages(messages: Messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages: item {i} must be a dict with a string 'role'")
        # An assistant turn that called tools may have no text (OpenAI sends content null).
        called = bool(message.get("tool_calls"))
        if not isinstance(message.get("content"), str) and not (called and message.get("content") is None):
            raise ValueError(f"messages: item {i} must have a string 'content'")
