"""xgrammar grammars of `StructuredOutputsParams`, shared by the frontend and the engine core.

The frontend builds the grammar of each constrained request to refuse, with a 400, what cannot
compile; the engine core compiles the same grammar against the model's vocabulary. xgrammar
imports torch, so it is loaded on first use: a process that never sees a constrained request
never pays for it.
"""

from __future__ import annotations

import re
from typing import Any

from zllm.sampling_params import StructuredOutputsParams

# NOTE: compact JSON (", " and ": " between items, no newlines). With any whitespace allowed a
# model may fill max_tokens with blanks before the first brace; vLLM offers the same switch
# (disable-any-whitespace), and compact output is also fewer tokens.
JSON_ANY_WHITESPACE = False
# Any JSON object, for OpenAI's {"type": "json_object"}: not strict, so it may have any keys.
_ANY_OBJECT = '{"type": "object"}'


def xgrammar() -> Any:
    import xgrammar as xgr

    return xgr


def grammar_of(params: StructuredOutputsParams) -> Any:
    """The xgrammar Grammar of a constraint; ValueError("structured_outputs: why") if it has none."""
    kind, text = params.grammar_spec()
    xgr = xgrammar()
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, any_whitespace=JSON_ANY_WHITESPACE)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(f"structured_outputs: {_reason(kind, error)}") from None


def _reason(kind: str, error: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:83: ")."""
    message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())
    what = {"json": "the JSON schema", "regex": "the regex", "grammar": "the grammar"}.get(kind, "the constraint")
    return f"{what} cannot be compiled: {message}"
