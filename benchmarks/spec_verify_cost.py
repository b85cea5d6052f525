"""The cost of verification: one decode step that scores 1 + k tokens per request (a request's
last token and k drafts) against the plain 1-token step, at a fixed context, on the worker.

Drives the in-process worker's ModelRunner directly with hand-made steps (no proposer, no engine
core): after each timed step the request is put back to the same context, so every step sees the
same shape. Both steps replay the decode CUDA graph (a verifying step is k + 1 decode rows per
request). Prints one JSON line; the speedup the published acceptance lengths would give is
step_ratio / mean tokens per step.

    python benchmarks/spec_verify_cost.py --model /tmp/zllm-llama3-8b --load-format dummy --k 4

With --profile it first prints one JSON line per step kind (k = 0 and k) from torch.profiler:
device time per step by category (attention, linear, sampling, copies, other), the 15 kernels
with the most time (and how often each runs a step), the device time of each worker phase
(inputs, forward, sample, finish) and its host range (under the profiler, so inflated), and the
host time per step: the unprofiled median wall time minus the device's busy time. On a CPU the
"device" is the CPU's torch ops (their self time), so the host time is the Python around them;
there the profiler's own cost inflates each op (host_ms can go below zero), and the CPU attention
(C called through ctypes, not a torch op) counts as host time: a smoke test, not a figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

# First match wins: a kernel's (or, on a CPU, an aten op's) lower-cased name -> its category.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("attention", ("attention", "attn", "flash", "sdpa")),
    ("linear", ("gemv", "gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "aten::mm", "aten::addmm",
                "aten::linear", "aten::matmul", "aten::bmm")),
    ("sampling", ("argmax", "softmax", "sort", "topk", "cumprod", "cumsum", "scan", "exponential", "rand",
                  "gather", "scatter", "where", "aten::eq", "compare", "aten::clamp", "aten::div")),
    ("copies", ("memcpy", "memset", "copy", "aten::to", "aten::_to", "fill", "aten::index")),
]  # fmt: skip
PHASES = {  # ModelRunner method -> the phase its time counts for
    "_prepare_inputs": "inputs",
    "_forward": "forward",
    "sample_step": "sample",
    "finish_step": "finish",
}


def category_of(name: str) -> str:
    lowered = name.lower()
    return next((category for category, keys in CATEGORIES if any(k in lowered for k in keys)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--acceptance-length", type=float, default=3.08, help="tokens gained per step (published)")
    parser.add_argument("--profile", action="store_true", help="also print where each step kind's time goes")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()

    from zllm import LLM

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # a shared CPU: threads that wait for a core swamp a tiny model's figures
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        async_scheduling=False,
    )
    runner = llm.engine.core.executor.runner
    step = _stepper(runner, args)
    times = {}
    for k in (0, args.k, 0, args.k):  # interleaved twice; the second round is kept
        for warm in range(5):
            step(10 + warm, k)
        times[k] = [step(100 + i, k) for i in range(args.iters)]
    plain, verify = statistics.median(times[0]) * 1e3, statistics.median(times[args.k]) * 1e3
    if args.profile:
        for k, wall_ms in ((0, plain), (args.k, verify)):
            print(json.dumps(_profile(runner, step, k, wall_ms, args.profile_steps)), flush=True)
    ratio = verify / plain
    print(
        json.dumps(
            {
                "gpu": _device_name(runner.device),
                "batch_size": args.batch_size,
                "context": args.context,
                "k": args.k,
                "plain_step_ms": round(plain, 3),
                "verify_step_ms": round(verify, 3),
                "step_ratio": round(ratio, 3),
                "acceptance_length": args.acceptance_length,
                "implied_speedup": round(args.acceptance_length / ratio, 3),
            }
        ),
        flush=True,
    )
    llm.shutdown()


def _stepper(runner, args: argparse.Namespace) -> Callable[[int, int], float]:
    """Prefills `batch_size` requests of `context` random tokens; returns step(step_id, k), which
    runs one decode step with k random drafts per request and returns its wall seconds."""
    from zllm.ipc.messages import CachedRequestData, NewRequestData, StepInput
    from zllm.sampling_params import SamplingParams

    vocab = runner.spec.vocab_size
    rng = random.Random(0)
    blocks_each = -(-(args.context + args.k + 2) // runner.block_size)
    ids = [f"r{i}" for i in range(args.batch_size)]
    greedy = SamplingParams(temperature=0.0)
    low = min(100, vocab // 2)
    prefill = StepInput(step_id=1, new_requests=[], cached_requests=[], scheduled_ids=[], num_scheduled_tokens=[])
    for i, rid in enumerate(ids):
        prompt = [rng.randrange(low, vocab) for _ in range(args.context)]
        blocks = list(range(i * blocks_each, (i + 1) * blocks_each))
        prefill.new_requests.append(NewRequestData(rid, args.context, prompt, greedy, blocks, 0))
        prefill.scheduled_ids.append(rid)
        prefill.num_scheduled_tokens.append(args.context)
    runner.execute_step(prefill)  # each request now knows context + 1 tokens, context computed
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else lambda: None

    def step(step_id: int, k: int) -> float:
        drafts = {rid: [rng.randrange(low, vocab) for _ in range(k)] for rid in ids} if k else {}
        cached = [CachedRequestData(rid, [], args.context) for rid in ids]
        message = StepInput(step_id, [], cached, list(ids), [1 + k] * len(ids), spec_token_ids=drafts)
        sync()
        start = time.perf_counter()
        runner.execute_step(message)
        sync()
        elapsed = time.perf_counter() - start
        for rid in ids:  # back to the same context for the next step
            del runner.requests[rid].token_ids[args.context + 1 :]
        return elapsed

    return step


def _profile(runner, step: Callable[[int, int], float], k: int, wall_ms: float, steps: int) -> dict:
    """One step kind under torch.profiler: device time per step by category, top kernels, phases,
    and the host time (the unprofiled wall_ms minus the device's busy time)."""
    cuda = runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for warm in range(3):
        step(200 + warm, k)
    with _phases_marked(runner), torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            step(300 + i, k)
    busy_us, by_category, kernels = 0.0, defaultdict(float), defaultdict(lambda: [0.0, 0])
    for name, us in _busy_events(prof.events(), cuda):
        busy_us += us
        by_category[category_of(name)] += us
        kernels[name][0] += us
        kernels[name][1] += 1
    phases, phases_host = defaultdict(float), defaultdict(float)
    cpu = torch.autograd.DeviceType.CPU
    for event in prof.events():  # the host's range of each phase (with CUDA, the device's copy of it is left out)
        if event.device_type == cpu and event.name.startswith("spec_verify_cost."):
            phase = event.name.split(".", 1)[1]
            phases[phase] += event.device_time_total if cuda else event.cpu_time_total
            phases_host[phase] += event.cpu_time_total
    top = sorted(kernels.items(), key=lambda item: item[1][0], reverse=True)[:15]
    per_step = 1e3 * steps  # us over all steps -> ms per step
    busy_ms = busy_us / per_step
    return {
        "profile": "verify" if k else "plain",
        "k": k,
        "device": _device_name(runner.device),
        "wall_ms": round(wall_ms, 3),
        "device_busy_ms": round(busy_ms, 3),
        "host_ms": round(wall_ms - busy_ms, 3),
        "categories_ms": {c: round(by_category[c] / per_step, 3) for c in [*(c for c, _ in CATEGORIES), "other"]},
        "phases_ms": {p: round(phases[p] / per_step, 3) for p in PHASES.values()},
        "phases_host_ms": {p: round(phases_host[p] / per_step, 3) for p in PHASES.values()},  # profiled: inflated
        "top_kernels": [
            {"name": name[:100], "ms": round(us / per_step, 4), "count": round(count / steps, 2)}
            for name, (us, count) in top
        ],
    }


def _busy_events(events, cuda: bool):
    """(name, µs) of each device kernel, copy and fill (not the device-side ranges of the phase
    annotations); on a CPU, of each torch op's self time (so that nested ops count once and the
    Python between them not at all)."""
    cpu = torch.autograd.DeviceType.CPU
    for event in events:
        if _is_annotation(event) or (event.device_type == cpu) == cuda:
            continue
        yield event.name, event.device_time_total if cuda else event.self_cpu_time_total


def _is_annotation(event) -> bool:
    return getattr(event, "is_user_annotation", False) or event.name.startswith(("ProfilerStep", "spec_verify_cost."))


class _phases_marked:
    """Wraps the runner's methods in PHASES in profiler ranges for the duration of a `with`."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def __enter__(self) -> None:
        for method, phase in PHASES.items():
            original = getattr(self.runner, method)

            def marked(*args, _original=original, _phase=phase, **kwargs):
                with torch.profiler.record_function(f"spec_verify_cost.{_phase}"):
                    return _original(*args, **kwargs)

            setattr(self.runner, method, marked)

    def __exit__(self, *exc) -> None:
        for method in PHASES:
            delattr(self.runner, method)  # the instance attribute; the class's method shows again


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
