"""The start-up heap out of the garbage collector's way, in every long-lived zllm process.

A collection of Python's oldest generation walks every tracked object. After start-up a frontend,
an engine core or a worker holds millions of them (torch, transformers, the tokenizer, the model's
modules) that live until exit, so each such collection paused the process for hundreds of
milliseconds while requests waited: on an H100 at Poisson 32 req/s this was most of the served
p99 time to first token (582 ms with the collector as is, 97 ms with it off; docs/benchmarks.md).
`gc.freeze()` moves what is alive into a permanent generation the collector no longer walks;
what requests allocate afterwards is collected as before.
"""

from __future__ import annotations

import gc
import logging
import time

from zllm import envs

logger = logging.getLogger(__name__)


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
