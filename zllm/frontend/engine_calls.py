"""Clients' stats and utility calls, fanned out to every engine that is up and answered once all
have answered: the part of the FrontendServer that talks to all engines at once.

    client ClientStats / ClientUtility ──> UtilityCall to each engine up (one engine call id each)
    engine UtilityResults ──> when none is pending: ServerStats (merged) / ServerUtilityResult

An engine that fails meanwhile is left out of stats, and fails a utility call.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from zllm.frontend.engines import EngineLink
from zllm.ipc.messages import ClientUtility, ServerStats, ServerUtilityResult, UtilityCall, UtilityResult

# Engine utilities a client may call by name (ClientUtility).
CLIENT_UTILITIES = ("reset_prefix_cache",)

SendToClient = Callable[[bytes, object], Awaitable[bool]]


@dataclass(slots=True)
class _Call:
    """A client's stats or utility call, sent to every engine that is up."""

    identity: bytes
    client_call_id: int
    method: str
    pending: dict[int, int] = field(default_factory=dict)  # engine call id -> dp rank, until answered
    results: dict[int, UtilityResult] = field(default_factory=dict)  # by dp rank


class EngineCalls:
    """The calls in flight to the engines, by engine call id, and how each is answered."""

    def __init__(
        self,
        engines: list[EngineLink],
        call_ids: itertools.count,
        send: SendToClient,
        server_stats: Callable[[], dict],
    ) -> None:
        self.engines = engines
        self._call_ids = call_ids  # shared with the engines' pings: call ids are unique across engines
        self._send = send
        self._server_stats = server_stats  # the frontend's own part of every stats answer
        self._calls: dict[int, _Call] = {}  # engine utility call id -> the client call it answers

    async def stats(self, identity: bytes, client_call_id: int) -> None:
        call = _Call(identity, client_call_id, "stats")
        if not self._fan_out(call):
            await self._send(identity, ServerStats(call_id=client_call_id, stats=self._server_stats()))

    async def utility(self, identity: bytes, message: ClientUtility) -> None:
        if message.method not in CLIENT_UTILITIES:
            error = f"method: {message.method!r} is not one of {list(CLIENT_UTILITIES)}"
            await self._send(identity, ServerUtilityResult(call_id=message.call_id, error=error))
            return
        call = _Call(identity, message.call_id, message.method)
        if any(engine.recovering for engine in self.engines) or not self._fan_out(call):
            error = "the engine is restarting after a failure; retry later"
            await self._send(identity, ServerUtilityResult(call_id=message.call_id, error=error))

    async def answer(self, engine: EngineLink, result: UtilityResult) -> None:
        """An engine's UtilityResult: file it, and answer the client once every engine has."""
        call = self._calls.pop(result.call_id, None)  # None: a ping
        if call is not None:
            del call.pending[result.call_id]
            call.results[engine.dp_rank] = result
            await self._answer_when_complete(call)

    async def engine_failed(self, engine: EngineLink) -> None:
        """Calls the failed engine will never answer: stats are answered without it, other
        utilities get an error."""
        for call_id, call in [(i, c) for i, c in self._calls.items() if c.pending.get(i) == engine.dp_rank]:
            del self._calls[call_id], call.pending[call_id]
            call.results[engine.dp_rank] = UtilityResult(
                call_id=call_id, error="the engine failed before answering; retry later"
            )
            await self._answer_when_complete(call)

    def _fan_out(self, call: _Call) -> bool:
        """Send a utility call to every engine that is up; False if none took it."""
        for engine in self.engines:
            call_id = next(self._call_ids)
            if not engine.recovering and engine.send(UtilityCall(call_id=call_id, method=call.method)):
                self._calls[call_id] = call
                call.pending[call_id] = engine.dp_rank
        return bool(call.pending)

    async def _answer_when_complete(self, call: _Call) -> None:
        """Answer the client's call once every engine it went to has answered (or failed)."""
        if call.pending:
            return
        if call.method == "stats":
            per_engine = {rank: r.result or {} for rank, r in call.results.items() if r.error is None}
            stats = {**merge_engine_stats(per_engine), **self._server_stats()}
            await self._send(call.identity, ServerStats(call_id=call.client_call_id, stats=stats))
            return
        errors = [r.error for r in call.results.values() if r.error is not None]
        results = [r.result for r in call.results.values()]
        result = None if errors else results[0] if len(results) == 1 else all(results)
        error = "; ".join(errors) or None
        await self._send(call.identity, ServerUtilityResult(call_id=call.client_call_id, result=result, error=error))


def _merge_spec_decode(merged: dict, engines) -> None:
    """Speculative decoding's rates over every engine's counts, and the per-position counts added."""
    drafts, tokens = merged.get("spec_decode_num_drafts", 0), merged.get("spec_decode_num_draft_tokens", 0)
    accepted = merged.get("spec_decode_num_accepted_tokens", 0)
    if "spec_decode_num_drafts" in merged:
        merged["spec_decode_acceptance_rate"] = accepted / tokens if tokens else 0.0
        merged["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
    per_position: list[int] = []
    for stats in engines:
        for position, count in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos") or []):
            per_position.extend([0] * (position + 1 - len(per_position)))
            per_position[position] += count
    if per_position:
        merged["spec_decode_num_accepted_tokens_per_pos"] = per_position


def merge_engine_stats(per_engine: dict[int, dict]) -> dict:
    """One view of several engines' stats: counts added up, KV cache usage and the prefix-cache
    hit rate over all of them, and each engine's own stats under "engines" (with its dp_rank)."""
    if not per_engine:
        return {}
    merged: dict = {}
    for stats in per_engine.values():
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
    merged["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for s in per_engine.values()) / len(per_engine)
    queries = merged.get("prefix_cache_queries", 0)
    merged["prefix_cache_hit_rate"] = merged.get("prefix_cache_hits", 0) / queries if queries else 0.0
    _merge_spec_decode(merged, per_engine.values())
    merged["engines"] = [{"dp_rank": rank, **per_engine[rank]} for rank in sorted(per_engine)]
    return merged
