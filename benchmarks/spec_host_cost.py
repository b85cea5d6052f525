"""Host work of a speculative step against a plain one, in the offline engine (core and worker in
this process, synchronous steps): perf_counter around the engine core's schedule and update and
the worker's phases, per step, medians over `--steps` steps. The forward (and the logits) is
timed too but left out of `host_us`: on a GPU it is device work, while everything else here is
the Python that runs around it.

    python benchmarks/spec_host_cost.py --model DIR --k 4

A periodic prompt, greedy, ignore_eos: n-gram finds a match at nearly every step. Prints one JSON
line per engine (plain, n-gram k) with µs per step for each phase (medians; the speculative
engine's over the steps that verified drafts) and the tokens per step. By default the clock is
this thread's CPU time (torch on one thread), so a loaded machine's waits for a core are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch


class StepPhases:
    """Wraps bound methods so each call adds its µs (of `clock`) to a named phase of the current step."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner, method_name: str, phase: str) -> None:
        original, clock = getattr(owner, method_name), self.clock

        def timed(*args, **kwargs):
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[phase] += (clock() - start) * 1e6

        setattr(owner, method_name, timed)

    def end_step(self, total_us: float) -> None:
        self.current["step"] = total_us
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def medians(self, steps: list[dict[str, float]]) -> dict[str, float]:
        phases = sorted({phase for step in steps for phase in step})
        return {phase: round(statistics.median(step.get(phase, 0.0) for step in steps), 1) for phase in phases}


def run_engine(args: argparse.Namespace, speculative: dict | None) -> dict:
    from zllm import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(
        args.model,
        max_model_len=args.max_model_len,
        async_scheduling=False,
        speculative_config=speculative,
        max_num_seqs=args.batch_size,
    )
    vocab = engine.processor.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.max_model_len, ignore_eos=True, detokenize=False)
    for i in range(args.batch_size):
        prompt = [(7 * i + t % args.period) % vocab for t in range(args.prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(args.warmup):
        engine.step()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    phases = _wrap_phases(engine, clock)
    lengths: dict[str, list[int]] = defaultdict(list)  # request id -> its output length after each step
    for _ in range(args.steps):
        start = clock()
        outputs = engine.step()
        phases.end_step((clock() - start) * 1e6)
        for out in outputs:
            lengths[out.request_id].append(len(out.outputs[0].token_ids))
    tokens = sum(seen[-1] - seen[0] for seen in lengths.values())
    engine.shutdown()
    # A speculative engine's steps without drafts (no n-gram match) are plain steps: left out.
    kept = [step for step in phases.steps if speculative is None or step.get("sample.verify", 0.0) > 0]
    host = statistics.median(step["step"] - step.get("forward", 0.0) - step.get("logits", 0.0) for step in kept)
    return {
        "engine": "plain" if speculative is None else f"ngram k={args.k}",
        "batch_size": args.batch_size,
        "clock": args.clock,
        "steps": len(kept),
        "tokens_per_step": round(tokens / (args.steps - 1) / args.batch_size, 2),
        "host_us": round(host, 1),
        "phases_us": phases.medians(kept),
    }


def _wrap_phases(engine, clock) -> StepPhases:
    phases = StepPhases(clock)
    core = engine.core
    runner = core.executor.runner
    phases.wrap(core.scheduler, "schedule", "core.schedule")
    phases.wrap(core.scheduler, "update_from_output", "core.update")
    phases.wrap(runner, "_prepare_inputs", "inputs")
    phases.wrap(runner, "_forward", "forward")
    phases.wrap(runner.model, "compute_logits", "logits")
    phases.wrap(runner, "sample_step", "sample")
    phases.wrap(runner, "_verify_drafts", "sample.verify")
    phases.wrap(runner, "finish_step", "finish")
    if runner.proposer is not None:
        phases.wrap(runner.proposer, "propose", "finish.propose")
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--period", type=int, default=8, help="the prompt repeats every this many tokens")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: less noise on a shared CPU)")
    parser.add_argument(
        "--clock",
        choices=["thread", "wall"],
        default="thread",
        help="thread: this thread's CPU time (a loaded CPU's waits left out)",
    )
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # A step computes up to 1 + k tokens, so a request ends after max_model_len / (1 + k) steps at best.
    args.steps = min(args.steps, (args.max_model_len - args.prompt_len) // (1 + args.k) - args.warmup - 2)
    speculative = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.prompt_lookup_min}
    for config in (None, speculative):
        print(json.dumps(run_engine(args, config)), flush=True)


if __name__ == "__main__":
    main()
