"""Where the device waits during an offline run: a per-step timeline of W1 under async scheduling.

    python benchmarks/step_timeline.py --model DIR --load-format dummy --num-prompts 1000 \
        --input-len 256 --output-len 256 --max-num-batched-tokens 8192

Runs `LLM.generate` as benchmarks/throughput.py does (same engine, same scheduling, async on
CUDA), with a CUDA event recorded on the worker's stream just before each step's launch and one
just after its sampling is queued. From those events, per step: its device span (the first
kernel of its forward to its last sampling kernel, gaps inside the step included) and the
device's idle time before it (the previous step's end to this step's start event, which the
device reaches at once when it has nothing left to do, so a positive gap is time it sat idle
waiting for the host). Steps are sorted by kind: decode (every row one token), mixed (decodes
and prompt chunks) and prefill (prompt chunks only). Prints one JSON line: the run's wall time,
the lead-in (generate's call to the first step's start event: the requests being added), the
tail (the last step's end to generate's return), and per kind the steps, tokens, device span,
idle before, and the host's mean time in `launch_step`; plus the longest idle gaps.

On a CPU (a dry run: no events) every time is the host's, and the device columns mean little.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field


def step_kind(num_scheduled_tokens: list[int]) -> str:
    decodes = sum(1 for n in num_scheduled_tokens if n == 1)
    if decodes == len(num_scheduled_tokens):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


class HostStamp:
    """Stands in for a CUDA event on a CPU: the host's clock when recorded."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, later: HostStamp) -> float:
        return (later.at - self.at) * 1000.0


@dataclass
class StepRecord:
    kind: str
    tokens: int
    host_launch_s: float
    start: object  # the event recorded before the launch
    end: object | None = None  # the event recorded after sampling was queued


@dataclass
class Timeline:
    stamp: object  # () -> an event recorded now on the current stream
    steps: list[StepRecord] = field(default_factory=list)
    by_launch: dict[int, StepRecord] = field(default_factory=dict)

    def wrap(self, runner) -> None:
        launch, sample = runner.launch_step, runner.sample_step

        def timed_launch(step_input):
            if step_input.is_empty:
                return launch(step_input)
            start = self.stamp()
            began = time.perf_counter()
            launched = launch(step_input)
            record = StepRecord(
                step_kind(list(step_input.num_scheduled_tokens)),
                sum(step_input.num_scheduled_tokens),
                time.perf_counter() - began,
                start,
            )
            self.steps.append(record)
            self.by_launch[id(launched)] = record
            return launched

        def timed_sample(launched, *args, **kwargs):
            result = sample(launched, *args, **kwargs)
            record = self.by_launch.pop(id(launched), None)
            if record is not None:
                record.end = self.stamp()
            return result

        runner.launch_step, runner.sample_step = timed_launch, timed_sample


def summarize(timeline: Timeline, called, returned, wall_s: float, top: int = 8) -> dict:
    """Seconds per kind of step, the idle time before each step, the lead-in and the tail."""
    steps = [s for s in timeline.steps if s.end is not None]
    kinds: dict[str, dict[str, float]] = defaultdict(
        lambda: {"steps": 0, "tokens": 0, "device_span_s": 0.0, "idle_before_s": 0.0, "host_launch_s": 0.0}
    )
    gaps = []
    previous_end = None
    for index, step in enumerate(steps):
        row = kinds[step.kind]
        row["steps"] += 1
        row["tokens"] += step.tokens
        row["device_span_s"] += step.start.elapsed_time(step.end) / 1000
        row["host_launch_s"] += step.host_launch_s
        if previous_end is not None:
            idle = max(0.0, previous_end.elapsed_time(step.start) / 1000)
            row["idle_before_s"] += idle
            gaps.append((idle, index, steps[index - 1].kind, step.kind))
        previous_end = step.end
    out = {}
    for kind, row in sorted(kinds.items()):
        out[kind] = {
            "steps": row["steps"],
            "tokens": row["tokens"],
            "device_span_s": round(row["device_span_s"], 3),
            "device_ms_per_step": round(row["device_span_s"] / row["steps"] * 1000, 3),
            "idle_before_s": round(row["idle_before_s"], 3),
            "host_launch_ms_per_step": round(row["host_launch_s"] / row["steps"] * 1000, 3),
        }
    gaps.sort(reverse=True)
    return {
        "wall_s": round(wall_s, 3),
        "lead_in_s": round(called.elapsed_time(steps[0].start) / 1000, 3) if steps else None,
        "tail_s": round(steps[-1].end.elapsed_time(returned) / 1000, 3) if steps else None,
        "idle_between_steps_s": round(sum(g[0] for g in gaps), 3),
        "kinds": out,
        "longest_gaps": [
            {"idle_ms": round(idle * 1000, 3), "step": index, "after": before, "before": kind}
            for idle, index, before, kind in gaps[:top]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    import torch

    from zllm import LLM, SamplingParams
    from zllm.config import runs_on_cuda

    llm = LLM(
        args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
    )
    cuda = runs_on_cuda(llm.engine.config)

    def stamp():
        if not cuda:
            return HostStamp()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    rng = random.Random(0)
    vocab = llm.engine.processor.vocab_size
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up, as throughput.py
    timeline = Timeline(stamp)
    timeline.wrap(llm.engine.core.executor.runner)
    if cuda:
        torch.cuda.synchronize()
    called = stamp()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    returned = stamp()
    wall = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    summary = summarize(timeline, called, returned, wall)
    print(
        json.dumps(
            {
                "benchmark": "step_timeline",
                "num_prompts": args.num_prompts,
                "requests_per_s": round(args.num_prompts / wall, 3),
                "max_num_seqs": llm.engine.config.max_num_seqs,
                "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
                "async_scheduling": llm.engine.config.async_scheduling,
                **summary,
                "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
