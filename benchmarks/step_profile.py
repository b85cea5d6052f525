"""Where one engine step's time goes, in the offline engine (frontend, core and worker in one
process, tp 1): host phases timed with perf_counter around the engine's own methods, GPU kernel
time from torch.profiler over the same steps.

    python benchmarks/step_profile.py --model DIR --load-format dummy --batch-size 256

Admits `batch-size` requests of `input-len` random tokens (ignore_eos), runs until all of them
decode, then measures `--steps` pure-decode steps. Prints one JSON line: ms per step for each
phase, and the share of wall time the GPU was busy. Synchronous steps: schedule, worker (prepare
inputs + forward + logits + sampling + waiting for the tokens), update, output processing. Async
scheduling (the default on CUDA): the worker's launch (inputs + forward + logits, no waiting),
sample, finish (which waits for the step's tokens: the host's idle time) are timed on their own.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict


class PhaseTimer:
    """Wraps bound methods so each call adds its wall time to a named phase."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, owner, method_name: str, phase: str) -> None:
        original = getattr(owner, method_name)

        def timed(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start

        setattr(owner, method_name, timed)


def _top_kernels(prof, steps: int, count: int) -> dict[str, float]:
    """The kernels with the most device time, ms per step (names cut to 60 characters)."""
    events = sorted(
        (e for e in prof.key_averages() if e.device_time_total > 0 and not e.key.startswith("ProfilerStep")),
        key=lambda e: e.device_time_total,
        reverse=True,
    )
    return {e.key[:60]: round(e.device_time_total / 1000 / steps, 3) for e in events[:count]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--quantization", "-q", default=None, help="fp8: FP8 weights, quantized while loading")
    parser.add_argument("--kv-cache-dtype", default="auto", help="fp8: an FP8 E4M3 KV cache")
    args = parser.parse_args()

    import torch

    from zllm import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=max(8192, args.batch_size),
        async_scheduling=args.async_scheduling,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    rng = random.Random(0)
    vocab = engine.processor.vocab_size
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_model_len - args.input_len - 1, ignore_eos=True, detokenize=False
    )
    for i in range(args.batch_size):
        engine.add_request(
            str(i), {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}, params
        )
    decoding: set[str] = set()
    while len(decoding) < args.batch_size:  # every prompt prefilled and sampling
        decoding.update(out.request_id for out in engine.step())
    for _ in range(5):  # settle into pure decode
        engine.step()

    timer = PhaseTimer()
    core = engine.core
    timer.wrap(core.scheduler, "schedule", "schedule")
    runner = core.executor.runner
    timer.wrap(core.executor, "execute_step", "worker")
    timer.wrap(runner, "launch_step", "worker.launch")
    timer.wrap(runner, "_prepare_inputs", "worker.launch.prepare_inputs")
    timer.wrap(runner, "_forward", "worker.launch.forward")
    timer.wrap(runner, "sample_step", "worker.sample")
    timer.wrap(runner, "finish_step", "worker.finish (waits for the device)")
    timer.wrap(core.scheduler, "update_from_output", "update")
    timer.wrap(engine.outputs, "process", "output_processing")
    timer.enabled = True
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernel_us = sum(
        e.device_time_total
        for e in prof.key_averages()
        if e.device_time_total > 0 and not e.key.startswith("ProfilerStep")
    )
    per_step = {phase: round(total / args.steps * 1000, 3) for phase, total in sorted(timer.totals.items())}
    print(
        json.dumps(
            {
                "benchmark": "step_profile",
                "batch_size": args.batch_size,
                "steps": args.steps,
                "quantization": args.quantization,
                "kv_cache_dtype": args.kv_cache_dtype,
                "async_scheduling": engine.config.async_scheduling,
                "wall_ms_per_step": round(wall / args.steps * 1000, 3),
                "phase_ms_per_step": per_step,
                "gpu_kernel_ms_per_step": round(kernel_us / 1000 / args.steps, 3),
                "gpu_busy_share": round(kernel_us / 1e6 / wall, 3),
                "top_kernels_ms_per_step": _top_kernels(prof, args.steps, 12),
                "gpu": torch.cuda.get_device_name(0),
            }
        ),
        flush=True,
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
