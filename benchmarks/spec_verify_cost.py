"""The cost of verification: one decode step that scores 1 + k tokens per request (a request's
last token and k drafts) against the plain 1-token step, at a fixed context, on the worker.

Drives the in-process worker's ModelRunner directly with hand-made steps (no proposer, no engine
core): after each timed step the request is put back to the same context, so every step sees the
same shape. The 1-token step replays the decode CUDA graph; the 1 + k step runs the piecewise
graphs with attention between them (what a speculative step runs). Prints one JSON line; the
speedup the published acceptance lengths would give is step_ratio / mean tokens per step.

    python benchmarks/spec_verify_cost.py --model /tmp/zllm-llama3-8b --load-format dummy --k 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch


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
    args = parser.parse_args()

    from zllm import LLM
    from zllm.ipc.messages import CachedRequestData, NewRequestData, StepInput
    from zllm.sampling_params import SamplingParams

    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=1024, async_scheduling=False)
    runner = llm.engine.core.executor.runner
    vocab = runner.spec.vocab_size
    rng = random.Random(0)
    blocks_each = -(-(args.context + args.k + 2) // runner.block_size)
    ids = [f"r{i}" for i in range(args.batch_size)]
    greedy = SamplingParams(temperature=0.0)
    prefill = StepInput(step_id=1, new_requests=[], cached_requests=[], scheduled_ids=[], num_scheduled_tokens=[])
    for i, rid in enumerate(ids):
        prompt = [rng.randrange(100, vocab) for _ in range(args.context)]
        blocks = list(range(i * blocks_each, (i + 1) * blocks_each))
        prefill.new_requests.append(NewRequestData(rid, args.context, prompt, greedy, blocks, 0))
        prefill.scheduled_ids.append(rid)
        prefill.num_scheduled_tokens.append(args.context)
    runner.execute_step(prefill)  # each request now knows context + 1 tokens, context computed

    def step(step_id: int, k: int) -> float:
        drafts = {rid: [rng.randrange(100, vocab) for _ in range(k)] for rid in ids} if k else {}
        cached = [CachedRequestData(rid, [], args.context) for rid in ids]
        message = StepInput(step_id, [], cached, list(ids), [1 + k] * len(ids), spec_token_ids=drafts)
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.execute_step(message)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        for rid in ids:  # back to the same context for the next step
            del runner.requests[rid].token_ids[args.context + 1 :]
        return elapsed

    times = {}
    for k in (0, args.k, 0, args.k):  # interleaved twice; the second round is kept
        for warm in range(5):
            step(10 + warm, k)
        times[k] = [step(100 + i, k) for i in range(args.iters)]
    plain, verify = statistics.median(times[0]) * 1e3, statistics.median(times[args.k]) * 1e3
    ratio = verify / plain
    print(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(0),
                "batch_size": args.batch_size,
                "context": args.context,
                "k": args.k,
                "plain_step_ms": round(plain, 3),
                "verify_step_ms": round(verify, 3),
                "step_ratio": round(ratio, 3),
                "acceptance_length": args.acceptance_length,
                "implied_speedup": round(args.acceptance_length / ratio, 3),
            }
        )
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
