"""Racing asyncio tasks: wait for the first to finish, cancel the rest and wait until they have ended.

The frontend races an engine's loops against its processes' exits and the server's loops against
each other; the node agent its loops and the second signal; the service its start-up, serving and
drain against signals. Each contender is a task or an event (it finishes when set).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable

Contender = asyncio.Task | asyncio.Event


async def race(*contenders: Contender, keep: Collection[asyncio.Task] = ()) -> set[Contender]:
    """Wait until the first contender finishes; cancel the others and wait until they have ended.
    Returns those that finished. Tasks in `keep` race too but are left running: the caller still
    needs them (e.g. the serving loop, raced against a signal that starts a drain)."""
    waits = {_as_task(contender): contender for contender in contenders}
    try:
        finished, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return {waits[task] for task in finished}
    finally:
        await cancel_and_wait(*(task for task, contender in waits.items() if contender not in keep))


async def first_result(tasks: Iterable[asyncio.Task]):
    """The result (or error) of whichever task finishes first; the others are cancelled."""
    return (await race(*tasks)).pop().result()


async def cancel_and_wait(*tasks: asyncio.Task) -> None:
    """Cancel these tasks and return once they have ended (their errors are dropped)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _as_task(contender: Contender) -> asyncio.Task:
    return contender if isinstance(contender, asyncio.Task) else asyncio.create_task(contender.wait())
