"""Many client streams at once over one AsyncClient, with an optional kill once each has some
tokens: what every stream delivered, or the error it ended with."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from zllm import AsyncClient


@dataclass
class Streamed:
    """What one stream delivered, delta by delta (of completion 0; n > 1: `more` has the others)."""

    tokens: list[int]
    text: str
    more: dict[int, tuple[list[int], str]] = field(default_factory=dict)


@dataclass
class Ended:
    """A stream that ended with an error, and when (wall clock)."""

    error: Exception
    at: float


async def run_streams(
    endpoint: str, prompts: list, params, kill=None, kill_after_tokens: int = 2, **client_args
) -> tuple[list[Streamed | Ended], float | None]:
    """Stream every prompt at once (params: one SamplingParams, or one per prompt); optionally
    call kill() once each stream has some tokens. Returns what each stream got, and the kill time."""
    counts = [0] * len(prompts)
    killed_at = None
    params = params if isinstance(params, list) else [params] * len(prompts)
    async with AsyncClient(endpoint, timeout=120, **client_args) as client:

        async def consume(i: int) -> Streamed | Ended:
            got = Streamed([], "")
            try:
                async for delta in client.stream(prompts[i], params[i]):
                    completion = delta.outputs[0]
                    if completion.index == 0:
                        got.tokens += completion.token_ids
                        got.text += completion.text
                    else:
                        tokens, text = got.more.get(completion.index, ([], ""))
                        got.more[completion.index] = (tokens + completion.token_ids, text + completion.text)
                    counts[i] = len(got.tokens)
            except Exception as error:  # noqa: BLE001 - the test inspects it
                return Ended(error, time.time())
            return got

        tasks = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
        if kill is not None:
            while min(counts) < kill_after_tokens and not any(t.done() for t in tasks):
                await asyncio.sleep(0.02)
            killed_at = time.time()
            kill()
        return await asyncio.gather(*tasks), killed_at
