"""W1's modelled GPU time per data-parallel engine: the real scheduler, costed step by step.

    python benchmarks/dp_gpu_model.py --requests 1000 500 250 [--max-num-seqs 512 ...]

Each engine's share of W1 (N requests of 256 in / 256 out) goes through zllm's Scheduler at the
given limits, with fabricated tokens; each step is costed with issue 20's H100 profile of the
Llama-3-8B shape (docs/benchmarks.md): 3.8 ms + 0.0424 ms per decode row + 0.024 ms per other
token (batch 256: 14.7 ms, 512: 25.5 ms, a full 8192-token mixed step ~200 ms). What a measured
run takes beyond this is host work, waiting, or the machine (issue 30: dp 2's missing seconds).
Prints one JSON line per share.
"""

from __future__ import annotations

import argparse
import json

from zllm.config import EngineConfig
from zllm.enginecore.block_pool import BlockPool
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.request import Request
from zllm.enginecore.scheduler import Scheduler
from zllm.ipc.messages import StepInput, StepOutput
from zllm.sampling_params import SamplingParams


def step_ms(step: StepInput) -> float:
    decodes = sum(1 for n in step.num_scheduled_tokens if n == 1)
    return 3.8 + 0.0424 * decodes + 0.024 * (step.total_num_scheduled_tokens - decodes)


def sampling_ids(scheduler: Scheduler, step: StepInput) -> list[str]:
    """The scheduled requests whose step samples, asked right after `schedule()`: each holds the
    placeholder of that token, one position past what the step computes (synchronous or async,
    where earlier tokens may still be in flight too). A chunk that stops short has none."""
    requests = (scheduler.requests.get(i) for i in step.scheduled_ids)
    return [
        r.request_id
        for r in requests
        if r is not None and r.num_output_placeholders and r.num_computed_tokens == r.num_tokens_with_placeholders - 1
    ]


def build_scheduler(args, async_scheduling: bool = False, prefix_caching: bool = False) -> Scheduler:
    """The real scheduler at args' limits (max_model_len, max_num_seqs, max_num_batched_tokens,
    num_blocks), over a block pool of that size, 16-token blocks."""
    config = EngineConfig(
        model="unused",
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=16,
        async_scheduling=async_scheduling,
    )
    return Scheduler(config, KVCacheManager(BlockPool(args.num_blocks), 16, prefix_caching))


def model(args, num_requests: int) -> dict:
    scheduler = build_scheduler(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(num_requests):
        scheduler.add_request(Request(str(i), [100 + (i + k) % 1000 for k in range(args.input_len)], params))
    total_ms, steps, with_prefill, most = 0.0, 0, 0, 0
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        total_ms += step_ms(step)
        steps += 1
        with_prefill += step.total_num_scheduled_tokens > sum(1 for n in step.num_scheduled_tokens if n == 1)
        most = max(most, len(step.scheduled_ids))
        ids = sampling_ids(scheduler, step)
        scheduler.update_from_output(StepOutput(step.step_id, ids, [7] * len(ids)))
    return {
        "requests": num_requests,
        "steps": steps,
        "steps_with_prefill": with_prefill,
        "largest_batch": most,
        "modelled_gpu_s": round(total_ms / 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[1000, 500, 250])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=55887, help="W1's on an H200 (141 GB)")
    args = parser.parse_args()
    for num_requests in args.requests:
        print(json.dumps(model(args, num_requests)))


if __name__ == "__main__":
    main()
