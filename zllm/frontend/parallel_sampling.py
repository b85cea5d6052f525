"""n > 1 as in vLLM v1: a request asking for n completions becomes n independent requests in
the engine core, one completion each, that share the prompt's KV blocks through the prefix
cache; the output processor merges their outputs back into one RequestOutput.

    request "r" (n=3, seed=7)  ->  "0_r" (seed 7)   "1_r" (seed 8)   "2_r" (seed 9)

A seeded request gives child i the seed `seed + i`, so every completion has its own random
stream and the whole request repeats exactly. Only child 0 computes prompt logprobs (they do not
depend on sampling), so the others can take the prompt from the cache.
"""

from __future__ import annotations

import msgspec

from zllm.ipc.messages import AddRequest

_SEED_MOD = 2**64


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def core_request_ids(request_id: str, n: int) -> list[str]:
    """The ids the engine core knows a request by: itself, or its n children."""
    return [request_id] if n == 1 else [child_request_id(request_id, i) for i in range(n)]


def fan_out(message: AddRequest) -> list[AddRequest]:
    """The messages for the engine core: the request itself when n == 1, else its n children."""
    n = message.sampling.n
    if n == 1:
        return [message]
    return [
        msgspec.structs.replace(message, request_id=child_id, sampling=_child_sampling(message, index))
        for index, child_id in enumerate(core_request_ids(message.request_id, n))
    ]


def _child_sampling(message: AddRequest, index: int):
    sampling = message.sampling
    changes: dict = {"n": 1}
    if sampling.seed is not None:
        changes["seed"] = (sampling.seed + index) % _SEED_MOD
    if index > 0:
        changes["prompt_logprobs"] = None
    return msgspec.structs.replace(sampling, **changes)


def best_of_indices(cumulative_logprobs: list[float | None], n: int) -> list[int]:
    """best_of: the indices of the n candidates with the highest cumulative logprob, best first
    (ties keep generation order; a candidate without logprobs ranks last)."""
    ranked = sorted(
        range(len(cumulative_logprobs)),
        key=lambda i: -cumulative_logprobs[i] if cumulative_logprobs[i] is not None else float("inf"),
    )
    return ranked[:n]
