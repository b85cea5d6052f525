"""The scheduler driven step by step with fabricated sampled tokens (no model, no workers)."""

from __future__ import annotations

from zllm.config import EngineConfig
from zllm.enginecore.block_pool import BlockPool
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.request import Request
from zllm.enginecore.scheduler import Scheduler
from zllm.ipc.messages import StepInput, StepOutput, TokenDelta
from zllm.sampling_params import SamplingParams

EOS = 2
TOKEN = 7


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = False,
    scheduling_policy: str = "fcfs",
    async_scheduling: bool = False,
    max_loras: int | None = None,
) -> Scheduler:
    """Prefix caching is off unless asked for: most tests pin other rules with block ids.
    max_loras: LoRA on, with that many adapters a step."""
    config = EngineConfig(
        model="unused",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        scheduling_policy=scheduling_policy,
        async_scheduling=async_scheduling,
        enable_lora=max_loras is not None,
        max_loras=max_loras or 1,
    )
    return Scheduler(config, KVCacheManager(BlockPool(num_blocks), block_size, enable_prefix_caching))


def prompt(length: int) -> list[int]:
    return [100 + i for i in range(length)]


def make_request(request_id: str, prompt_len: int = 4, *, max_tokens: int | None = 16, **sampling) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt(prompt_len),
        sampling=SamplingParams(temperature=0, max_tokens=max_tokens, **sampling),
        eos_token_ids=frozenset({EOS}),
    )


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def scheduled(step: StepInput) -> dict[str, int]:
    return dict(zip(step.scheduled_ids, step.num_scheduled_tokens))


def sampling_ids(scheduler: Scheduler, step: StepInput) -> list[str]:
    """The scheduled requests that reached the end of their tokens: the ones that sample."""
    ids = []
    for request_id in step.scheduled_ids:
        request = scheduler.requests.get(request_id)
        if request is not None and request.num_computed_tokens == request.num_tokens:
            ids.append(request_id)
    return ids


def complete(scheduler: Scheduler, step: StepInput, tokens: dict[str, int] | None = None) -> list[TokenDelta]:
    ids = sampling_ids(scheduler, step)
    sampled = [(tokens or {}).get(request_id, TOKEN) for request_id in ids]
    return scheduler.update_from_output(StepOutput(step.step_id, ids, sampled))


def run_step(scheduler: Scheduler, tokens: dict[str, int] | None = None) -> StepInput:
    step = scheduler.schedule()
    complete(scheduler, step, tokens)
    return step


def decode(scheduler: Scheduler, request_id: str, tokens: list[int]) -> list[TokenDelta]:
    """Run steps of a lone request, sampling `tokens` in turn; the deltas of that request."""
    deltas = []
    for token in tokens:
        step = scheduler.schedule()
        deltas += [d for d in complete(scheduler, step, {request_id: token}) if d.request_id == request_id]
    return deltas


def run_to_completion(scheduler: Scheduler, max_steps: int = 200) -> list[StepInput]:
    steps = []
    while scheduler.has_unfinished_requests():
        assert len(steps) < max_steps, "the scheduler stopped making progress"
        steps.append(run_step(scheduler))
    return steps


def num_used_blocks(scheduler: Scheduler) -> int:
    pool = scheduler.kv_cache.pool
    return pool.num_blocks - pool.num_free_blocks


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert sorted(pool._free.block_ids()) == list(range(pool.num_blocks))
