"""Sampling parameters: vLLM's `SamplingParams`, validated on construction.

It is a msgspec Struct because it travels from clients to the frontend, the engine core and the
workers. It is encoded as a map (only the fields that differ from the defaults), unknown field
names are rejected, and `__post_init__` runs on decode too, so a malformed message fails the
same checks as user input.
"""

from __future__ import annotations

import math

import msgspec

_UINT64_MAX = 2**64 - 1


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

    def _verify(self) -> None:
        _check(self.n == 1, "n", f"must be 1 for now (n > 1 is not supported yet), got {self.n}")
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


def _check(ok: bool, field: str, reason: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {reason}")


def _check_finite(value: float, field: str) -> None:
    _check(isinstance(value, (int, float)) and math.isfinite(value), field, f"must be a finite number, got {value!r}")
