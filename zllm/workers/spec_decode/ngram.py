"""N-gram proposals (prompt lookup decoding): find the request's latest n tokens earlier in its
own tokens (prompt and output), and propose the tokens that followed them there.

The longest suffix is tried first (prompt_lookup_max down to prompt_lookup_min), and the latest
earlier match wins, as in vLLM. Each lookup is a few numpy operations over the request's tokens
(a sliding-window comparison), with no Python loop over tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from zllm.workers.model_runner import RequestState


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    length = token_ids.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n :]
        # Windows that start before the suffix itself and leave at least one token after them.
        windows = sliding_window_view(token_ids[: length - 1], n)
        (starts,) = np.nonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return token_ids[follow : follow + k].tolist()
    return []


class NgramProposer:
    """Drafts for the requests that sampled in a step, from their own tokens. It keeps no state
    and no cache: every rank could propose the same, but only rank 0's drafts are used (the engine
    core hands them to every rank with the next step)."""

    needs_features = False

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, scheduled: list[RequestState], sampled: list[RequestState]) -> dict[str, list[int]]:
        drafts = {}
        for state in sampled:
            proposed = propose_ngram(np.asarray(state.token_ids, dtype=np.int64), self.min_n, self.max_n, self.k)
            if proposed:
                drafts[state.request_id] = proposed
        return drafts

    def track(self, request_id: str, num_computed_tokens: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def release_kv_cache(self) -> int:
        return 0
