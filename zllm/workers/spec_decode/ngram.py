"""N-gram proposals (prompt lookup decoding): find the request's latest n tokens earlier in its
own tokens (prompt and output), and propose the tokens that followed them there.

The longest suffix is tried first (prompt_lookup_max down to prompt_lookup_min), and the latest
earlier match wins, as in vLLM. Each lookup is one comparison over the request's tokens, then a
few numpy operations over the windows that still match, with no Python loop over tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from zllm.workers.model_runner import RequestState


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    length = token_ids.shape[0]
    # Candidates: the ends e < length - 1 of earlier windows that match the suffix's last n
    # tokens, grown one token at a time (n = 1, 2, ...): few survive each step, so this costs a
    # handful of small numpy calls, not one pass over the tokens per n.
    (ends,) = np.nonzero(token_ids[: length - 1] == token_ids[length - 1])
    best = -1
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[token_ids[ends - (n - 1)] == token_ids[length - n]]
        if ends.size == 0:
            break
        if n >= min_n:
            best = int(ends[-1])  # the latest window of the longest n so far
    if best < 0:
        return []
    return token_ids[best + 1 : best + 1 + k].tolist()


class NgramProposer:
    """Drafts for the requests that sampled in a step, from their own tokens. Its only state is a
    numpy copy of each request's tokens, extended by the new ones each step (a request's token
    list only grows while it lives here), so a lookup does not convert the whole list again.
    Every rank could propose the same, but only rank 0's drafts are used (the engine core hands
    them to every rank with the next step)."""

    needs_features = False

    def __init__(self, min_n: int, max_n: int, k: int, adaptive: bool = False) -> None:
        self.min_n, self.max_n, self.k = min_n, max_n, k
        self.adaptive = adaptive  # ZLLM_NGRAM_ADAPTIVE: each request's draft length follows what it kept
        self._arrays: dict[str, tuple[RequestState, np.ndarray, int]] = {}  # request id -> (state, copy, filled)
        self._last: dict[str, tuple[int, list[int], int]] = {}  # request id -> (cap, last draft, tokens then)

    def propose(self, scheduled: list[RequestState], sampled: list[RequestState]) -> dict[str, list[int]]:
        drafts = {}
        for state in sampled:
            tokens = self._tokens_of(state)
            cap = self._cap(state.request_id, tokens) if self.adaptive else self.k
            proposed = propose_ngram(tokens, self.min_n, self.max_n, cap)
            if proposed:
                drafts[state.request_id] = proposed
            if self.adaptive:
                self._last[state.request_id] = (cap, proposed, tokens.shape[0])
        return drafts

    def _cap(self, request_id: str, tokens: np.ndarray) -> int:
        """How many tokens to draft for this request now: k at first; after a draft the target
        rejected part of, one more than it kept; doubling (up to k) while whole drafts are kept.
        A verifying step costs more with every drafted row (past 8 rows the linear layers leave the
        small-batch GEMV) while a prompt-lookup draft that missed once tends to miss again, so
        chat-like text drafts short and copying drafts long. What was kept is read from the tokens
        that came back in the draft's place: a rejection always shows the target's own token where
        the draft's was; fewer tokens than the draft, all matching, mean it was not (all) scored
        (the core asked for fewer), and the cap stays. Only draft lengths depend on this, never
        which tokens are sampled."""
        last = self._last.get(request_id)
        if last is None:
            return self.k
        cap, draft, drafted_at = last
        grown = tokens[drafted_at : drafted_at + len(draft)]
        mismatches = np.flatnonzero(grown != np.asarray(draft[: grown.shape[0]], dtype=tokens.dtype))
        if mismatches.size:
            return int(mismatches[0]) + 1
        if draft and grown.shape[0] == len(draft):
            return min(self.k, 2 * max(cap, len(draft)))
        return cap

    def _tokens_of(self, state: RequestState) -> np.ndarray:
        tokens = state.token_ids
        owner, array, filled = self._arrays.get(state.request_id, (None, None, 0))
        if owner is not state or filled > len(tokens):  # a new request, or one that came back
            array, filled = np.empty(max(64, 2 * len(tokens)), dtype=np.int64), 0
        if len(tokens) > array.shape[0]:
            grown = np.empty(2 * len(tokens), dtype=np.int64)
            grown[:filled] = array[:filled]
            array = grown
        array[filled : len(tokens)] = tokens[filled:]
        self._arrays[state.request_id] = (state, array, len(tokens))
        return array[: len(tokens)]

    def track(self, request_id: str, num_computed_tokens: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)
        self._last.pop(request_id, None)

    def kv_cache_bytes_per_block(self) -> int:
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def release_kv_cache(self) -> int:
        return 0
