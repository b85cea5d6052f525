"""Which engine a new request goes to, when one frontend serves several data-parallel engines.

Each engine reports its scheduler's queue lengths with every EngineOutputs (num_waiting +
num_running); between two reports the frontend counts what it has sent that engine since, so a
burst of arrivals spreads instead of piling onto the engine that reported least. The least
loaded engine wins; among equally loaded ones, the engine that last took a prompt with the same
first KV block (the same prefix-cache key: tokens and cache salt) wins, so requests sharing a
prefix meet its cached blocks; otherwise the lowest rank. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from zllm.block_hash import BlockHash, hash_block


class LoadBalancer:
    def __init__(self, num_engines: int, block_size: int, affinity_capacity: int = 4096) -> None:
        if num_engines < 1 or block_size < 1 or affinity_capacity < 1:
            raise ValueError(
                f"num_engines {num_engines}, block_size {block_size} and affinity_capacity "
                f"{affinity_capacity} must be >= 1"
            )
        self.num_engines = num_engines
        self.block_size = block_size
        self.affinity_capacity = affinity_capacity
        self._reported = [0] * num_engines  # waiting + running at the engine's last report
        self._sent_since_report = [0] * num_engines
        self._affinity: OrderedDict[BlockHash, int] = OrderedDict()  # first block -> engine, LRU

    def report(self, rank: int, num_waiting: int, num_running: int) -> None:
        """An engine's queue lengths as it last reported them (what was sent before is in them)."""
        self._reported[rank] = num_waiting + num_running
        self._sent_since_report[rank] = 0

    def load(self, rank: int) -> int:
        """The engine's reported load plus the requests sent to it since that report."""
        return self._reported[rank] + self._sent_since_report[rank]

    def choose(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        live: Iterable[int] | None = None,
        count: int = 1,
    ) -> int:
        """The engine for a request of this prompt, among `live` ranks (default: all); `count`
        requests go there (n > 1 completions stay together, sharing their prompt's blocks)."""
        candidates = sorted(set(range(self.num_engines) if live is None else live))
        if not candidates or not all(0 <= rank < self.num_engines for rank in candidates):
            raise ValueError(f"no engine to choose from: live {candidates} of {self.num_engines}")
        lowest = min(self.load(rank) for rank in candidates)
        tied = [rank for rank in candidates if self.load(rank) == lowest]
        key = self._first_block(prompt_token_ids, cache_salt)
        remembered = self._affinity.get(key) if key is not None else None
        choice = remembered if remembered in tied else tied[0]
        if key is not None:
            self._affinity[key] = choice
            self._affinity.move_to_end(key)
            if len(self._affinity) > self.affinity_capacity:
                self._affinity.popitem(last=False)
        self._sent_since_report[choice] += count
        return choice

    def _first_block(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> BlockHash | None:
        # A prompt shorter than a block has no cached block to share.
        if len(prompt_token_ids) < self.block_size:
            return None
        return hash_block(None, list(prompt_token_ids[: self.block_size]), cache_salt)
