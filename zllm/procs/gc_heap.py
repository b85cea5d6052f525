"""The start-up heap out of the garbage collector's way, in every long-lived zllm process.

A collection of Python's oldest generation walks every tracked object. After start-up a frontend,
an engine core or a worker holds millions of them (torch, transformers, the tokenizer, the model's
modules) that live until exit, so each such collection paused the process for hundreds of
milliseconds while requests waited: on an H100 at Poisson 32 req/s this was most of the served
p99 time to first token (582 ms with the collector as is, 97 ms with it off; docs/benchmarks.md).
`gc.freeze()` moves what is alive into a permanent generation the collector no longer walks;
what requests allocate afterwards is collected as before.

The offline `LLM` runs its engine core and worker in the caller's process, so it freezes that
process's heap too once its engine has started, and thaws it when the engine shuts down: what
was frozen is collectable again, so an engine's model and cache do not outlive it by sitting in
a reference cycle the collector no longer looks at.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

from zllm import envs

logger = logging.getLogger(__name__)

# An oldest-generation threshold no run reaches: Python counts young-generation passes up to it.
_NEVER = 1 << 30


def freeze_startup_heap(process_name: str) -> int:
    """Collect once, then freeze every surviving object (ZLLM_GC_FREEZE, on by default). Call it
    when the process has finished starting. Returns the number of objects frozen (0: off)."""
    if not envs.ZLLM_GC_FREEZE:
        return 0
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d start-up objects frozen out of the garbage collector's walks (%.0f ms)",
        process_name,
        frozen,
        1000 * (time.perf_counter() - started),
    )
    return frozen


def thaw_heap() -> None:
    """Hand every frozen object back to the collector (gc.unfreeze), so garbage among them can be
    collected again: an in-process engine calls this when it shuts down."""
    gc.unfreeze()


@contextlib.contextmanager
def old_generation_deferred() -> Iterator[None]:
    """Within the block the collector runs its young passes as usual but no oldest-generation
    pass (ZLLM_GC_DEFER_OLD, on by default); the thresholds are restored at its end. During
    LLM.generate the requests' own objects (token lists, states, outputs) reach the oldest
    generation and each of its passes walked them all, ~30 ms every ~50 steps of W1 on an H200
    with the start-up heap already frozen (docs/benchmarks.md). Cycles that grow old meanwhile
    wait for the first oldest-generation pass after the block."""
    if not envs.ZLLM_GC_DEFER_OLD or not gc.isenabled():
        yield
        return
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)
    try:
        yield
    finally:
        gc.set_threshold(young, middle, old)
