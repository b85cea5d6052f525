"""Speculative decoding on the worker: proposers (n-gram lookup, a draft model, EAGLE heads) and the exact
rejection sampler that verifies their drafts (docs/architecture.md, *Speculative decoding*)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from zllm import envs

if TYPE_CHECKING:
    from zllm.workers.model_runner import ModelRunner, RequestState


class Proposer(Protocol):
    # True: the runner hands it each step's target features first (keep_features: EAGLE heads).
    needs_features: bool
    # A proposer with a model of its own may also have attention_shape: (heads, kv heads,
    # head_dim) on this rank; the runner then reserves the decode workspace for it too.

    def propose(self, scheduled: list[RequestState], sampled: list[RequestState]) -> dict[str, list[int]]:
        """Drafts for the next step of each request in `sampled` (all of them: `scheduled`)."""

    def track(self, request_id: str, num_computed_tokens: int) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def kv_cache_bytes_per_block(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def release_kv_cache(self) -> int:
        """Drop the KV cache; returns the bytes it held."""


def make_proposer(runner: ModelRunner) -> Proposer | None:
    """The proposer the engine's speculative config asks for (None: speculation is off)."""
    speculative = runner.config.speculative_config
    if speculative is None:
        return None
    if speculative.method == "ngram":
        from zllm.workers.spec_decode.ngram import NgramProposer

        return NgramProposer(
            speculative.prompt_lookup_min,
            speculative.prompt_lookup_max,
            speculative.num_speculative_tokens,
            adaptive=envs.ZLLM_NGRAM_ADAPTIVE,
        )
    if speculative.method == "draft_model":
        from zllm.workers.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(runner, speculative.model, speculative.num_speculative_tokens)
    if speculative.method in ("eagle", "eagle3"):
        from zllm.workers.spec_decode.eagle import EagleProposer

        return EagleProposer(runner, speculative.model, speculative.method, speculative.num_speculative_tokens)
    raise ValueError(f"speculative_config.method: {speculative.method!r} is not served")
