"""Where an offline workload's time goes, by kind of step (issue 20's "measure first").

    python benchmarks/step_mix.py --model DIR --load-format dummy --num-prompts 1000 \
        --input-len 256 --output-len 256 --max-num-batched-tokens 8192

Runs the workload through the offline engine (one process, tp 1) with synchronous steps, so each
step's wall time is its own: the worker's `execute_step` is timed with a device synchronisation
at its end. Steps are sorted into kinds: pure decode replayed from a CUDA graph, pure decode run
eagerly (no graph holds the batch), mixed (decodes plus prefill chunks, eager), and prefill only.
Prints one JSON line: per kind the number of steps, tokens, total seconds and ms per step, and
the share of the run's wall time; plus the histogram of tokens per mixed step.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict


def step_kind(num_tokens: int, num_decodes: int, graphed: bool) -> str:
    if num_decodes == num_tokens:
        return "decode_graph" if graphed else "decode_eager"
    return "prefill_only" if num_decodes == 0 else "mixed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()

    import torch

    from zllm import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=False,
    )
    runner = engine.core.executor.runner
    records: list[tuple[str, int, float]] = []
    forward = runner._forward

    def timed_forward(batch):
        meta = batch.attention
        num_tokens = batch.input_ids.shape[0]
        graphed = runner.graphs is not None and meta.num_decodes == num_tokens and runner.graphs.bucket(num_tokens)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hidden = forward(batch)
        torch.cuda.synchronize()
        records.append(
            (step_kind(num_tokens, meta.num_decodes, bool(graphed)), num_tokens, time.perf_counter() - start)
        )
        return hidden

    runner._forward = timed_forward
    execute = engine.core.executor.execute_step
    step_walls: list[float] = []

    def timed_execute(step):
        start = time.perf_counter()
        out = execute(step)
        step_walls.append(time.perf_counter() - start)
        return out

    engine.core.executor.execute_step = timed_execute
    rng = random.Random(0)
    vocab = engine.processor.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    for i in range(args.num_prompts):
        engine.add_request(
            str(i), {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}, params
        )
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    kinds: dict[str, dict[str, float]] = defaultdict(lambda: {"steps": 0, "tokens": 0, "forward_s": 0.0})
    mixed_sizes: dict[int, int] = defaultdict(int)
    for kind, tokens, seconds in records:
        kinds[kind]["steps"] += 1
        kinds[kind]["tokens"] += tokens
        kinds[kind]["forward_s"] += seconds
        if kind == "mixed":
            mixed_sizes[1 << (tokens - 1).bit_length()] += 1
    for entry in kinds.values():
        entry["forward_ms_per_step"] = round(entry["forward_s"] / entry["steps"] * 1000, 3)
        entry["share_of_wall"] = round(entry["forward_s"] / wall, 3)
        entry["forward_s"] = round(entry["forward_s"], 3)
    print(
        json.dumps(
            {
                "benchmark": "step_mix",
                "num_prompts": args.num_prompts,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "wall_s": round(wall, 3),
                "requests_per_s": round(args.num_prompts / wall, 2),
                "worker_step_s": round(sum(step_walls), 3),
                "kinds": dict(kinds),
                "mixed_tokens_histogram_pow2": dict(sorted(mixed_sizes.items())),
                "gpu": torch.cuda.get_device_name(0),
            }
        ),
        flush=True,
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
