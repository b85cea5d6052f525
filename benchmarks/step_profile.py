"""Where one engine step's time goes, in the offline engine (frontend, core and worker in one
process, tp 1): host phases timed with perf_counter around the engine's own methods, GPU kernel
time from torch.profiler over the same steps.

    python benchmarks/step_profile.py --model DIR --load-format dummy --batch-size 256

Admits `batch-size` requests of `input-len` random tokens (ignore_eos), runs until all of them
decode, then measures `--steps` pure-decode steps. `--mixed-prompt-len P` makes every measured step
a mixed one instead: before each, a request of P new prompt tokens (one output token) joins the
batch, as a served step that carries a prompt chunk does; `--cprofile` adds the host functions
with the most own time over the measured steps (where a host-bound step's launch goes). Prints one JSON line: ms per step for each
phase, and the share of wall time the GPU was busy. Synchronous steps: schedule, worker (prepare
inputs + forward + logits + sampling + waiting for the tokens), update, output processing. Async
scheduling (the default on CUDA): the worker's launch (inputs + forward + logits, no waiting),
sample, finish (which waits for the step's tokens: the host's idle time) are timed on their own.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
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


def print_host_profile(step, steps: int, count: int, sync) -> None:
    """`steps` calls of step() under cProfile: the `count` functions with the most own time, in ms
    per step (own, cumulative) and calls per step."""
    profile = cProfile.Profile()
    sync()
    profile.enable()
    for _ in range(steps):
        step()
    sync()
    profile.disable()
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    print(f"== host functions by own time under cProfile (ms per step own / cumulative, calls per step), {steps} steps")
    for (file, line, name), (_, calls, own, cumulative, _) in rows:
        where = file.split("site-packages/")[-1].split("/zllm/", 1)[-1]
        print(f"{own / steps * 1e3:8.3f} {cumulative / steps * 1e3:8.3f} {calls / steps:7.1f}  {name} ({where}:{line})")


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
    parser.add_argument(
        "--mixed-prompt-len", default="0", help="P[,P...]: a P-token prompt joins every measured step (0: none)"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 8192 or more")
    parser.add_argument("--mixed-graph-max-tokens", type=int, default=None, help="the engine's (default: its own)")
    parser.add_argument("--cprofile", type=int, default=0, help="print this many host functions by own time")
    args = parser.parse_args()

    import torch

    from zllm import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch_size + 1,  # room for the joining prompt of a mixed step
        max_num_batched_tokens=args.max_num_batched_tokens
        or max([8192, args.batch_size] + [args.batch_size + int(p) for p in args.mixed_prompt_len.split(",")]),
        async_scheduling=args.async_scheduling,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        mixed_graph_max_tokens=args.mixed_graph_max_tokens,
    )
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)  # a CPU dry run too
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
    joiner = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def step(prompt_len: int) -> None:
        if prompt_len:  # one prompt chunk in every step; it leaves after its one token
            prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
            engine.add_request(f"mixed-{rng.random()}", {"prompt_token_ids": prompt}, joiner)
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
    launched_kinds: list[bool] = []  # per measured launch: did it carry prompt tokens
    launch = runner.launch_step

    def counted_launch(step_input):
        if timer.enabled and not step_input.is_empty:
            launched_kinds.append(any(n > 1 for n in step_input.num_scheduled_tokens))
        return launch(step_input)

    runner.launch_step = counted_launch
    if getattr(runner, "pieces", None) is not None:
        timer.wrap(runner.pieces, "run", "worker.launch.forward.pieces")
    activity = (
        torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU
    )
    for prompt_len in [int(p) for p in args.mixed_prompt_len.split(",")]:
        for _ in range(3):  # this step shape warmed up
            step(prompt_len)
        timer.totals.clear()
        launched_kinds.clear()
        timer.enabled = True
        sync()
        with torch.profiler.profile(activities=[activity]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(prompt_len)
            sync()
            wall = time.perf_counter() - start
        timer.enabled = False
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
                    "mixed_prompt_len": prompt_len,
                    "steps": args.steps,
                    "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                    "mixed_graph_max_tokens": engine.config.mixed_graph_max_tokens,
                    "quantization": args.quantization,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "async_scheduling": engine.config.async_scheduling,
                    "steps_with_prompt_tokens": sum(launched_kinds),
                    "launches": len(launched_kinds),
                    "wall_ms_per_step": round(wall / args.steps * 1000, 3),
                    "phase_ms_per_step": per_step,
                    "gpu_kernel_ms_per_step": round(kernel_us / 1000 / args.steps, 3),
                    "gpu_busy_share": round(kernel_us / 1e6 / wall, 3),
                    "top_kernels_ms_per_step": _top_kernels(prof, args.steps, 12),
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                }
            ),
            flush=True,
        )
        if args.cprofile:  # a second run under cProfile (which slows the host): where its time goes
            print_host_profile(lambda: step(prompt_len), args.steps, args.cprofile, sync)
    engine.shutdown()


if __name__ == "__main__":
    main()
