"""The encoder cache as the engine core keeps account of it: which images' encoder outputs the
workers hold, by image hash, and who still needs each.

The workers hold exactly what this says (they encode what `StepInput.encode` names and drop what
`StepInput.freed_mm_hashes` names, before the step's forward), so the scheduler can cut a prefill
chunk anywhere inside an image: the image is encoded once, in the step that first computes any of
its tokens, and its later chunks read the cached output. An entry stays while a request whose
computed tokens have not passed the image's end uses it; then it is kept, least recently used
first out, until room is needed, so a repeated image (another request's, or a preempted request
resumed) is not encoded again.

```
 capacity 8 tokens   [img A: 4, users {r1}] [img B: 3, users {}]   free 1
 r2 needs C (4 tokens): B (unused) is evicted -> freed_mm_hashes [B]; C added, encode [C]
```
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Entry:
    num_tokens: int
    users: set[str] = field(default_factory=set)


class EncoderCache:
    def __init__(self, capacity: int) -> None:
        """capacity: EngineConfig.encoder_cache_tokens (the workers' memory profile holds as much)."""
        self.capacity = capacity
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._used = 0
        self._freed: list[str] = []  # evicted since the last step: the workers drop them
        self.queries = 0  # images a scheduled request needed
        self.hits = 0  # of which the workers held already

    def holds(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def can_fit(self, num_tokens: int) -> bool:
        """Whether num_tokens more fit, once every entry no request uses is evicted."""
        evictable = sum(e.num_tokens for e in self._entries.values() if not e.users)
        return self._used - evictable + num_tokens <= self.capacity

    def add(self, mm_hash: str, num_tokens: int, request_id: str) -> None:
        """A new entry the workers encode this step (the caller checked can_fit)."""
        for victim in [h for h, e in self._entries.items() if not e.users]:
            if self._used + num_tokens <= self.capacity:
                break
            self._used -= self._entries.pop(victim).num_tokens
            self._freed.append(victim)
        self._entries[mm_hash] = _Entry(num_tokens, {request_id})
        self._used += num_tokens
        self.queries += 1

    def use(self, mm_hash: str, request_id: str) -> None:
        """A request reads an entry the workers hold (a hit, the first time it asks)."""
        entry = self._entries[mm_hash]
        if request_id not in entry.users:
            entry.users.add(request_id)
            self.queries += 1
            self.hits += 1
        self._entries.move_to_end(mm_hash)

    def release(self, mm_hash: str, request_id: str) -> None:
        """The request needs the entry no more (it stays until room is needed)."""
        entry = self._entries.get(mm_hash)
        if entry is not None:
            entry.users.discard(request_id)

    def is_used_by(self, mm_hash: str, request_id: str) -> bool:
        entry = self._entries.get(mm_hash)
        return entry is not None and request_id in entry.users

    def forget(self, mm_hash: str) -> None:
        """Drop an entry added this step that no one will encode after all (its request was taken
        back out of the step): the workers never held it."""
        entry = self._entries.pop(mm_hash, None)
        if entry is not None:
            self._used -= entry.num_tokens
            self.queries -= 1

    def take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    @property
    def num_tokens(self) -> int:
        return self._used
