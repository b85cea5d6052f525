"""Sampling parameters: vLLM's `SamplingParams`, validated on construction.

It is a msgspec Struct because it travels from clients to the frontend, the engine core and the
workers. It is encoded as a map (only the fields that differ from the defaults), unknown field
names are rejected, and `__post_init__` runs on decode too, so a malformed message fails the
same checks as user input.
"""

from __future__ import annotations

import json
import math

import msgspec

_UINT64_MAX = 2**64 - 1


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """Constrain a completion to a grammar (vLLM's names); exactly one kind is set."""

    json: str | dict | None = None  # a JSON schema, as an object or as its JSON text
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF, in the dialect xgrammar reads (GBNF)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    # A reasoning model's end-of-thinking tokens: the grammar applies only once the output has
    # written them (the thinking is free, the answer constrained). Set by the HTTP API's
    # reasoning parser; not part of the grammar (nor of its cache key). Appended last.
    starts_after: list[int] | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        _check(
            len(kinds) == 1,
            "structured_outputs",
            f"set exactly one of json, regex, choice, grammar, json_object; got {kinds or 'none'}",
        )
        if self.starts_after is not None:
            _check(
                len(self.starts_after) > 0 and all(isinstance(t, int) and t >= 0 for t in self.starts_after),
                "structured_outputs",
                "starts_after must be a non-empty list of token ids",
            )
        if self.choice is not None:
            _check(
                len(self.choice) > 0 and all(isinstance(c, str) for c in self.choice),
                "structured_outputs",
                "choice must be a non-empty list of strings",
            )

    def grammar_spec(self) -> tuple[str, str]:
        """(kind, text): what the grammar engine compiles, and the key its cache keeps it under.
        kind is "json" (a schema's JSON text), "regex", "grammar" (EBNF) or "json_object".
        A choice is the grammar of its alternatives, each a string literal."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(
                self.json
            )  # key order kept: it is the output's
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            # JSON string literals are EBNF string literals: quotes and backslashes escaped.
            return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample the completion of one prompt (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as in vLLM) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (benchmarks; stop strings then cannot apply)
    # NOTE: fields are append-only; this struct is part of the wire format.
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF/CTRL: divides (or multiplies) logits of prompt and output tokens
    logprobs: int | None = None  # top-k logprobs per sampled token (plus the sampled token's own)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt position (plus the prompt token's own)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    bad_words: list[str] | None = None  # words (token sequences) that must never be completed
    structured_outputs: StructuredOutputsParams | None = None  # grammar the completion must follow
    # Keep only the prompt's last k tokens (vLLM's left truncation); -1: the model's max_model_len.
    # Applied by the frontend's processor, which knows max_model_len (and refuses k above it).
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    @property
    def stop_strings(self) -> list[str]:
        return self.stop or []  # type: ignore[return-value]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _verify(self) -> None:
        _check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check_finite(self.temperature, "temperature")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check_finite(self.top_p, "top_p")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        _check_finite(self.min_p, "min_p")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check(0 <= self.seed <= _UINT64_MAX, "seed", f"must be in [0, 2**64), got {self.seed}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _check(self.detokenize or not self.stop_strings, "stop", "stop strings need detokenize=True")
        for s in self.stop_strings:
            _check(isinstance(s, str) and s != "", "stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids or []:
            _check(t >= 0, "stop_token_ids", f"token ids must be >= 0, got {t}")
        self._verify_penalties()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, name, f"must be None or >= 0, got {value}")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias", f"token ids must be >= 0, got {token_id}")
            _check_finite(bias, "logit_bias")
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"biases must be in [-100, 100], got {bias} for {token_id}")
        for word in self.bad_words or []:
            _check(isinstance(word, str) and word.strip() != "", "bad_words", "bad words must be non-empty strings")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)

    def _verify_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_finite(value, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check_finite(self.repetition_penalty, "repetition_penalty")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")


def check_truncate_prompt_tokens(value: int | None) -> None:
    """vLLM's rule: an integer >= 1, or -1 (the model's max_model_len); None: no truncation."""
    if value is not None:
        ok = type(value) is int and (value >= 1 or value == -1)
        _check(ok, "truncate_prompt_tokens", f"must be an integer >= 1 or -1, got {value!r}")


def _check(ok: bool, field: str, reason: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {reason}")


def _check_finite(value: float, field: str) -> None:
    _check(isinstance(value, (int, float)) and math.isfinite(value), field, f"must be a finite number, got {value!r}")
