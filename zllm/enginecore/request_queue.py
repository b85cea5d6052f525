"""The waiting queue, one per scheduling policy.

fcfs:     arrival order; a preempted request goes back to the front (it arrived before the rest).
priority: lowest `priority` value first, then earliest arrival; a preempted request simply
          goes back in, and its (priority, arrival) puts it where it belongs.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from zllm.enginecore.request import Request


def priority_key(request: Request) -> tuple[int, float, int]:
    """Smaller is served first; the largest running one is preempted first."""
    return (request.priority, request.arrival_time, request.sequence)


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (priority_key(request), request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In serving order (sorted; for inspection, not the hot path)."""
        return (request for _, request in sorted(self._heap, key=lambda entry: entry[0]))


WaitingQueue = FCFSQueue | PriorityQueue


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"scheduling_policy: must be 'fcfs' or 'priority', got {policy!r}")
