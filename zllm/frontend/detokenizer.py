"""Incremental detokenization, correct across multi-byte characters and byte-fallback tokens.

The tokenizers library's DecodeStream holds back bytes until they form whole UTF-8 characters;
it is seeded with the end of the prompt so the first output token decodes in context (a leading
space of a SentencePiece token is kept, as in the full text).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]) or None
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add_token(self, token_id: int) -> str:
        """Feed one token; return the text it completes (possibly empty)."""
        piece = self._stream.step(self._backend, token_id) or ""
        self.text += piece
        return piece
