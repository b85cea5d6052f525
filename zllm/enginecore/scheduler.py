"""The scheduler: one token budget per step, running requests first, then waiting ones.

There is no prefill phase and no decode phase: every scheduled request computes tokens until its
`num_computed_tokens` catches up with its token count. A long prompt that does not fit the budget
is computed over several steps (chunked prefill); a decode is a request one token behind.
A waiting request starts after the longest prefix of its blocks found in the prefix cache.
When the block pool runs dry, a running request is preempted — the latest one (fcfs), or the
one with the largest (priority, arrival) (priority) — its blocks are freed and it is recomputed
later (mostly from the prefix cache, if its blocks were not evicted meanwhile).

Async scheduling (`config.async_scheduling`): the core schedules step N+1 while step N runs, so a
request whose step N samples a token is scheduled again before that token is known: the token
is an output placeholder, whose position step N+1 computes; the workers put the sampled value in
on the device. A request whose token in flight may be its last (max_tokens, max_model_len) is
not scheduled again until it arrives; one that stops on EOS costs one discarded step.

Speculative decoding (`config.speculative_config`): the workers propose draft tokens for each
request that sampled; its next step computes its last token and the drafts (1 + k tokens, in the
token budget) and answers with the drafts accepted plus one token of the target's own. The
computed count is then rolled back past the rejected drafts: their KV slots are simply overwritten
by the next step, and no block hash ever covers a draft (hashes are made of known tokens only).
With a draft model or an EAGLE head, each step also allocates k slots past its end, where the
proposer writes its own KV entries while it proposes.
With synchronous steps the drafts come back in the answer and the next step carries them. Under
async scheduling the next step is scheduled before that answer, so it asks for up to k drafts
(-1 placeholders) that the workers propose themselves once they know the step's tokens, and it is
scheduled as if every draft in flight were accepted (the placeholders count 1 + k tokens): blocks
cover the longest outcome, and the answer rolls the computed count back as it does synchronously.
It asks only for requests whose latest answer came with drafts: one that finds none (chat, where
n-gram rarely matches) keeps the plain pipeline, whose steps never wait on the workers.

Images (vision-language models): a chunk that reaches an image's tokens needs the image's encoder
output; one the workers do not hold yet (zllm/enginecore/encoder_cache.py) is encoded in that step
if the step's encoder budget and the cache have room, else the chunk stops before the image.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from zllm.config import MODEL_SPECULATIVE_METHODS, EngineConfig
from zllm.enginecore.block_pool import KVBlock
from zllm.enginecore.encoder_cache import EncoderCache
from zllm.enginecore.kv_cache_manager import KVCacheManager
from zllm.enginecore.request import Request, RequestStatus
from zllm.enginecore.request_queue import make_waiting_queue, priority_key
from zllm.ipc.messages import CachedRequestData, NewRequestData, StepInput, StepOutput, TokenDelta, TokenLogprobs


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` call decided, before it becomes a StepInput."""

    budget: int
    encoder_budget: int = 0  # image tokens the workers may still encode this step
    encode: dict[str, list[int]] = field(default_factory=dict)  # request id -> its images to encode
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int, new_block_ids: list[int]) -> None:
        self.scheduled.append((request, num_tokens))
        self.new_block_ids[request.request_id] = new_block_ids
        self.budget -= num_tokens

    def remove(self, request: Request) -> None:
        """Take back a request scheduled earlier in this step (it was preempted after all)."""
        for index, (scheduled, num_tokens) in enumerate(self.scheduled):
            if scheduled is request:
                del self.scheduled[index]
                del self.new_block_ids[request.request_id]
                self.budget += num_tokens
                return


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_steps: int
    prefix_cache_queries: int  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int  # of which were found there
    prefix_cache_misses: int  # and were computed
    prefix_cache_hit_rate: float
    num_cached_blocks: int
    prefix_cache_evictions: int
    # Speculative decoding (vLLM's spec_decode counters): requests that had drafts scored, the
    # draft tokens scored, those accepted, and the accepted count at each draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    spec_decode_acceptance_rate: float = 0.0  # accepted / draft tokens
    spec_decode_mean_acceptance_length: float = 0.0  # tokens gained per drafted step: 1 + accepted / drafts
    # Vision-language models: images scheduled requests needed, and those the workers' encoder
    # cache held already (not encoded again).
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0


@dataclass(slots=True)
class SpecDecodeCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position.extend([0] * (num_drafts - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.async_scheduling = config.async_scheduling
        self.policy = config.scheduling_policy
        self.kv_cache = kv_cache
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(self.policy)
        self.running: list[Request] = []
        self._sequence = itertools.count()
        self._finished_ids: list[str] = []  # told to the workers with the next step
        self._preempted_ids: list[str] = []  # preempted outside schedule(): told with the next step
        self._step_id = 0
        self.num_preemptions = 0
        speculative = config.speculative_config
        self.max_drafts = speculative.num_speculative_tokens if speculative else 0
        # Slots past a step's end where a draft model writes while it proposes.
        self.num_lookahead = self.max_drafts if speculative and speculative.method in MODEL_SPECULATIVE_METHODS else 0
        self.drafts_off_at = (speculative.disable_by_batch_size if speculative else None) or None
        # Async scheduling: the workers propose the drafts of a step the core schedules ahead.
        self.worker_drafts = self.async_scheduling and self.max_drafts > 0
        self.spec = SpecDecodeCounters()
        self.encoder_cache = EncoderCache(config.encoder_cache_tokens)
        # LoRA: at most this many distinct adapters among the running requests, hence in any step
        # (each worker holds that many on its device).
        self.max_loras = config.max_loras if config.enable_lora else 0

    # ---- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        self._check_fits(request)
        self._check_images_fit(request)
        request.sequence = next(self._sequence)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _check_fits(self, request: Request) -> None:
        """A request whose longest possible length needs more blocks than the whole pool could
        never finish: refuse it now rather than let it wait (or thrash) forever."""
        max_tokens = request.sampling.max_tokens or self.max_model_len
        longest = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        chunk = self.max_num_batched_tokens + self.num_lookahead
        prompt_held = self.kv_cache.max_blocks_held(request.num_prompt_tokens + 1, chunk)
        for (needed, available), (prompt_needs, _) in zip(self.kv_cache.max_blocks_held(longest, chunk), prompt_held):
            if needed <= available:
                continue
            field_name = "prompt" if prompt_needs > available else "max_tokens"
            raise ValueError(
                f"{field_name}: {request.num_prompt_tokens} prompt tokens + up to {longest - request.num_prompt_tokens} "
                f"generated need {needed} KV blocks of {self.kv_cache.block_size} tokens, but the whole KV cache "
                f"has {available}; shorten the prompt, lower max_tokens or enlarge the KV cache"
            )

    def _check_images_fit(self, request: Request) -> None:
        for _, length, _ in request.image_spans:
            if length > self.encoder_cache.capacity:
                raise ValueError(
                    f"multi_modal_data: an image of {length} tokens exceeds the encoder cache "
                    f"({self.encoder_cache.capacity} tokens); send a smaller image"
                )

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Finish the given requests as aborted; returns the ids that were still unfinished."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._release(request)
            aborted.append(request_id)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        prefix = self.kv_cache.prefix_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions=self.num_preemptions,
            num_steps=self._step_id,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            prefix_cache_misses=prefix.queries - prefix.hits,
            prefix_cache_hit_rate=prefix.hit_rate,
            num_cached_blocks=sum(p.num_cached_blocks for p in self.kv_cache.pools),
            prefix_cache_evictions=sum(p.num_evictions for p in self.kv_cache.pools),
            spec_decode_num_drafts=self.spec.num_drafts,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec.accepted_per_position),
            spec_decode_acceptance_rate=(
                self.spec.num_accepted_tokens / self.spec.num_draft_tokens if self.spec.num_draft_tokens else 0.0
            ),
            spec_decode_mean_acceptance_length=(
                1 + self.spec.num_accepted_tokens / self.spec.num_drafts if self.spec.num_drafts else 0.0
            ),
            encoder_cache_queries=self.encoder_cache.queries,
            encoder_cache_hits=self.encoder_cache.hits,
        )

    def reset_prefix_cache(self) -> int:
        return self.kv_cache.reset_prefix_cache()

    # ---- scheduling ----------------------------------------------------------------------------

    def schedule(self) -> StepInput:
        plan = _StepPlan(budget=self.max_num_batched_tokens, encoder_budget=self.encoder_cache.capacity)
        self._schedule_running(plan)
        if not plan.preempted:
            # NOTE: admitting new work in a step that had to preempt would just thrash.
            self._schedule_waiting(plan)
        return self._to_step_input(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        drafting = self.max_drafts > 0 and (self.drafts_off_at is None or len(self.running) < self.drafts_off_at)
        for request in list(self.running):
            if plan.budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._may_finish_in_flight(request):
                continue
            num_tokens = self._num_tokens_to_schedule(request, plan.budget)
            num_tokens, encode = self._fit_images(request, request.num_computed_tokens, num_tokens, plan)
            if num_tokens == 0:
                continue
            request.num_scheduled_drafts = self._num_drafts_to_score(request, plan.budget) if drafting else 0
            num_tokens += request.num_scheduled_drafts
            new_block_ids = self._allocate_or_preempt(request, num_tokens, plan)
            if new_block_ids is None:
                break  # the request preempted itself: it was the least important one left
            plan.add(request, num_tokens, new_block_ids)
            self._take_images(request, request.num_computed_tokens, num_tokens, encode, plan)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        compiling: list[Request] = []  # passed over: their grammar is not ready, or no adapter slot is free
        adapters = self._running_adapters()
        num_without_slot = 0
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.grammar is not None and not request.grammar.is_ready:
                compiling.append(self.waiting.pop())
                continue
            if request.lora_id and request.lora_id not in adapters and len(adapters) >= self.max_loras:
                # Waits until a running adapter's requests finish. NOTE: a bounded look past such
                # requests, so a long queue of other adapters' requests costs little per step.
                num_without_slot += 1
                if num_without_slot > self.max_num_seqs:
                    break
                compiling.append(self.waiting.pop())
                continue
            cached_prefix = self.kv_cache.find_cached_prefix(request)
            num_cached_tokens = cached_prefix.num_blocks * self.kv_cache.block_size
            num_tokens = self._num_tokens_to_schedule(request, plan.budget, num_cached_tokens)
            num_tokens, encode = self._fit_images(request, num_cached_tokens, num_tokens, plan)
            if num_tokens == 0:
                break  # its image must wait for encoder room; the queue keeps its order
            total = num_cached_tokens + num_tokens
            with_lookahead = min(total + self.num_lookahead, self.max_model_len)
            new_block_ids = self.kv_cache.allocate_slots(request.request_id, with_lookahead, cached_prefix)
            if new_block_ids is None:
                break
            self.waiting.pop()
            self._admit(request, num_cached_tokens)
            if request.lora_id:
                adapters.add(request.lora_id)
            # Registered now, so that a request admitted next in this same step can share them:
            # every layer writes the whole batch's K/V before any request attends.
            self.kv_cache.cache_full_blocks(request, total)
            plan.add(request, num_tokens, new_block_ids)
            self._take_images(request, num_cached_tokens, num_tokens, encode, plan)
        for request in reversed(compiling):
            self.waiting.add_preempted(request)  # back where they were: at the front

    def _running_adapters(self) -> set[int]:
        return {request.lora_id for request in self.running if request.lora_id}

    def _admit(self, request: Request, num_cached_tokens: int) -> None:
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
        self.kv_cache.record_lookup(request.num_tokens, num_cached_tokens)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached_tokens
        request.on_workers = False  # sent in full with this step
        self.running.append(request)

    def _num_tokens_to_schedule(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        num_computed = request.num_computed_tokens if num_computed is None else num_computed
        room = self.max_model_len - num_computed
        known = request.num_tokens_with_placeholders if self.async_scheduling else request.num_tokens
        return max(0, min(known - num_computed, budget, room))

    # ---- images ----------------------------------------------------------------------------------

    def _fit_images(self, request: Request, start: int, num_tokens: int, plan: _StepPlan) -> tuple[int, list[int]]:
        """(tokens the step can compute of the num_tokens from `start`, the indices of the images
        it must encode first). An image the workers do not hold and the step's encoder budget or
        the cache cannot take ends the chunk before it."""
        end, encode, pending, seen = start + num_tokens, [], 0, set()
        for index, (offset, length, mm_hash) in enumerate(request.image_spans):
            if offset >= end or offset + length <= start or mm_hash in seen or self.encoder_cache.holds(mm_hash):
                continue
            if pending + length > plan.encoder_budget or not self.encoder_cache.can_fit(pending + length):
                return max(0, offset - start), encode
            encode.append(index)
            seen.add(mm_hash)
            pending += length
        return num_tokens, encode

    def _take_images(self, request: Request, start: int, num_tokens: int, encode: list[int], plan: _StepPlan) -> None:
        """The scheduled chunk's images: new cache entries for those to encode, uses of the rest."""
        end = start + num_tokens
        for index, (offset, length, mm_hash) in enumerate(request.image_spans):
            if offset >= end or offset + length <= start:
                continue
            if index in encode:
                self.encoder_cache.add(mm_hash, length, request.request_id)
                plan.encode.setdefault(request.request_id, []).append(index)
                plan.encoder_budget -= length
            else:
                self.encoder_cache.use(mm_hash, request.request_id)

    def _release_images(self, request: Request, up_to: int | None = None) -> None:
        """The request needs no more the images that end at or before `up_to` (None: any)."""
        for offset, length, mm_hash in request.image_spans:
            if up_to is None or offset + length <= up_to:
                self.encoder_cache.release(mm_hash, request.request_id)

    def _drop_planned_images(self, request: Request, plan: _StepPlan) -> None:
        """A request taken back out of the step: the images it was to encode are encoded by
        another request of the step that uses them, or forgotten (the workers never see them)."""
        for index in plan.encode.pop(request.request_id, []):
            mm_hash = request.image_spans[index][2]
            self.encoder_cache.release(mm_hash, request.request_id)
            heir = next(
                (
                    (other, i)
                    for other, _ in plan.scheduled
                    if other is not request
                    for i, span in enumerate(other.image_spans)
                    if span[2] == mm_hash and self.encoder_cache.is_used_by(mm_hash, other.request_id)
                ),
                None,
            )
            if heir is None:
                self.encoder_cache.forget(mm_hash)
            else:
                plan.encode.setdefault(heir[0].request_id, []).append(heir[1])

    def _num_drafts_to_score(self, request: Request, budget: int) -> int:
        """How many of the request's drafts its step scores: none unless it is one token behind
        (a decode), and never more than could become output (max_tokens, max_model_len) or than
        the budget holds beside its own token."""
        if self.worker_drafts:
            # The workers propose up to k (unknown here): counted as if every token in flight
            # came (placeholders), so the room is never overstated. Asked only while the latest
            # answer had drafts for it (a hint: a request without is not held back behind the
            # previous step's answer on the workers, so its steps pipeline as without drafts).
            # A grammar's drafts must be checked here before they are scored: constrained
            # requests go without.
            if (
                not request.spec_token_ids
                or request.grammar is not None
                or request.num_tokens_with_placeholders - request.num_computed_tokens != 1
            ):
                return 0
            proposed, num_tokens = self.max_drafts, request.num_tokens_with_placeholders
            num_output = request.num_output_tokens + request.num_output_placeholders
        else:
            if not request.spec_token_ids or request.num_uncomputed_tokens != 1:
                return 0
            proposed, num_tokens, num_output = (
                len(request.spec_token_ids),
                request.num_tokens,
                request.num_output_tokens,
            )
        room = self.max_model_len - num_tokens - 1
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - num_output - 1)
        return max(0, min(proposed, room, budget - 1))

    def _may_finish_in_flight(self, request: Request) -> bool:
        """A token in flight that reaches max_tokens or max_model_len ends the request: computing
        past it would only be thrown away."""
        pending = request.num_output_placeholders
        if not pending:
            return False
        max_tokens = request.sampling.max_tokens
        return (max_tokens is not None and request.num_output_tokens + pending >= max_tokens) or (
            request.num_tokens + pending >= self.max_model_len
        )

    def _allocate_or_preempt(self, request: Request, num_tokens: int, plan: _StepPlan) -> list[int] | None:
        """Allocate blocks for the request's next tokens, preempting running requests until they
        fit. Returns the new block ids, or None if the request itself was preempted."""
        total = min(request.num_computed_tokens + num_tokens + self.num_lookahead, self.max_model_len)
        # Blocks behind the sliding window of the step's first token are read by no later step.
        # (A step still in flight reads them before this one writes any reused block: the
        # workers run steps in order.)
        self.kv_cache.free_out_of_window(request.request_id, request.num_computed_tokens)
        while (new_block_ids := self.kv_cache.allocate_slots(request.request_id, total)) is None:
            victim = self._preemption_victim()
            plan.remove(victim)
            self._drop_planned_images(victim, plan)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return None
        return new_block_ids

    def _preemption_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        self._release_images(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.on_workers = False
        # Steps in flight still sample for it (one answer each); its tokens are recomputed after it resumes.
        request.num_stale_outputs += len(request.drafts_in_flight)
        request.num_output_placeholders = 0
        request.spec_token_ids, request.num_scheduled_drafts, request.drafts_in_flight = [], 0, []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def _to_step_input(self, plan: _StepPlan) -> StepInput:
        new_requests: list[NewRequestData] = []
        cached_requests: list[CachedRequestData] = []
        structured_ids: list[str] = []
        spec_token_ids: dict[str, list[int]] = {}
        for request, num_tokens in plan.scheduled:
            if not request.on_workers:
                new_requests.append(self._new_request_data(request))
                request.on_workers = True
            else:
                cached_requests.append(
                    CachedRequestData(
                        request_id=request.request_id,
                        new_block_ids=plan.new_block_ids[request.request_id],
                        num_computed_tokens=request.num_computed_tokens,
                        new_sliding_block_ids=self.kv_cache.take_new_sliding_block_ids(request.request_id),
                    )
                )
            request.num_computed_tokens += num_tokens
            if request.image_spans:
                self._release_images(request, request.num_computed_tokens)
            num_drafts = request.num_scheduled_drafts
            if num_drafts:
                spec_token_ids[request.request_id] = (
                    [-1] * num_drafts if self.worker_drafts else request.spec_token_ids[:num_drafts]
                )
            request.spec_token_ids, request.num_scheduled_drafts = [], 0
            if request.num_computed_tokens - num_drafts == request.num_tokens_with_placeholders:
                # This step samples its next token (and, async, may gain each draft too).
                request.num_output_placeholders += 1 + (num_drafts if self.worker_drafts else 0)
                request.drafts_in_flight.append(num_drafts)
                if request.grammar is not None:
                    structured_ids.append(request.request_id)
            # Block hashes cover known tokens only: a block holding a draft is never registered.
            self.kv_cache.cache_full_blocks(request, request.num_computed_tokens)
        self._step_id += 1
        step = StepInput(
            step_id=self._step_id,
            new_requests=new_requests,
            cached_requests=cached_requests,
            scheduled_ids=[r.request_id for r, _ in plan.scheduled],
            num_scheduled_tokens=[n for _, n in plan.scheduled],
            finished_ids=self._finished_ids,
            preempted_ids=self._preempted_ids + [r.request_id for r in plan.preempted],
            structured_ids=structured_ids,
            spec_token_ids=spec_token_ids,
            encode=plan.encode,
            freed_mm_hashes=self.encoder_cache.take_freed(),
        )
        self._finished_ids, self._preempted_ids = [], []
        return step

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            prompt_len=request.num_prompt_tokens,
            token_ids=list(request.all_token_ids),
            sampling=request.sampling,
            block_ids=self.kv_cache.block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
            eos_token_ids=sorted(request.eos_token_ids),
            bad_words_token_ids=request.bad_words_token_ids,
            sliding_block_ids=self.kv_cache.take_sliding_block_ids(request.request_id),
            mm_inputs=request.mm_inputs,
            lora=request.lora,
        )

    # ---- results -------------------------------------------------------------------------------

    def update_from_output(self, output: StepOutput) -> list[TokenDelta]:
        """Append sampled tokens, apply the stop rules, free what finished."""
        deltas = self._finish_failed(output.failed_requests)
        finished = bool(deltas)
        for request_id, rows in _rows_by_request(output.request_ids):
            request = self.requests.get(request_id)
            if request is None:
                continue  # finished or aborted while the step ran
            if request.num_stale_outputs:
                request.num_stale_outputs -= 1  # sampled before it was preempted
                continue
            if request.status != RequestStatus.RUNNING:
                continue
            num_drafts = request.drafts_in_flight.pop(0) if request.drafts_in_flight else 0
            request.num_output_placeholders -= 1 + (num_drafts if self.worker_drafts else 0)
            tokens = output.sampled_token_ids[rows.start : rows.stop]
            self._roll_back_rejected_drafts(request, num_drafts, len(tokens) - 1)
            if output.num_drafts_scored.get(request_id):
                self.spec.record(output.num_drafts_scored[request_id], len(tokens) - 1)
            kept = self._append_tokens(request, tokens)  # the workers appended them on their side already
            if not request.status.is_finished:  # async: the drafts are a hint (see _num_drafts_to_score)
                drafts = output.draft_token_ids.get(request_id, [])[: self.max_drafts]
                request.spec_token_ids = self._drafts_to_keep(request, drafts)
            deltas.append(
                TokenDelta(
                    request_id=request_id,
                    new_token_ids=tokens[:kept],
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    logprobs=_logprobs_rows(output.logprobs, rows.start, kept, request.sampling.logprobs),
                    prompt_logprobs=output.prompt_logprobs.get(request_id),
                    error=_GRAMMAR_REJECTED if request.status == RequestStatus.FINISHED_ERROR else None,
                )
            )
            if request.status.is_finished:
                self._release(request)
                finished = True
        if finished:
            self.running = [r for r in self.running if not r.status.is_finished]
        return deltas

    @staticmethod
    def _drafts_to_keep(request: Request, drafts: list[int]) -> list[int]:
        """A constrained request keeps the drafts its grammar allows (the leading ones): a draft
        the grammar forbids could never be accepted, nor could any after it."""
        if not drafts or request.grammar is None or not request.grammar.is_ready:
            return drafts
        return request.grammar.valid_drafts(drafts)

    @staticmethod
    def _roll_back_rejected_drafts(request: Request, num_drafts: int, num_accepted: int) -> None:
        """The step was scheduled to compute `num_drafts` drafts; those the workers rejected (or,
        async, never proposed) are not its tokens, so its computed count steps back over them
        (their slots are rewritten next step). A later step already scheduled on top stays on top."""
        request.num_computed_tokens -= num_drafts - num_accepted

    def _append_tokens(self, request: Request, tokens: list[int]) -> int:
        """Append the step's tokens in order until one ends the request; returns how many were
        kept (the tokens after a stop are dropped, as decoding one by one would never make them)."""
        for kept, token_id in enumerate(tokens, start=1):
            request.append_output_token(token_id)
            self._apply_stop_rules(request, token_id)
            if request.grammar is not None and not request.grammar.accept(token_id) and not request.status.is_finished:
                # NOTE: cannot happen while rank 0 masks with the grammar's bitmask; if it does, the
                # output no longer follows the grammar, so end it rather than go on unconstrained.
                request.status = RequestStatus.FINISHED_ERROR
            if request.status.is_finished:
                return kept
        return len(tokens)

    def _finish_failed(self, failures: dict[str, str]) -> list[TokenDelta]:
        """End each request the workers could not take, alone: free its blocks and tell the
        frontend why (finish_reason "error"). The caller drops them from `running`."""
        deltas = []
        uncomputed: set[KVBlock] = set()
        for request_id, reason in failures.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            uncomputed.update(self.kv_cache.blocks(request_id))
            request.status = RequestStatus.FINISHED_ERROR
            self._release(request)  # the workers dropped it already; the finished id is harmless
            deltas.append(TokenDelta(request_id, [], finish_reason="error", error=reason))
        if uncomputed:
            self._recompute_readers(uncomputed)
        return deltas

    def fail_waiting(self, failures: dict[str, str]) -> list[TokenDelta]:
        """End waiting requests that can never run (their grammar did not compile), alone."""
        deltas = []
        for request_id, reason in failures.items():
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            self._release(request)
            deltas.append(TokenDelta(request_id, [], finish_reason="error", error=reason))
        return deltas

    def _recompute_readers(self, blocks: set[KVBlock]) -> None:
        """A failed request's blocks entered the prefix cache when they were scheduled (so that
        requests admitted in the same step share them), but the workers never computed them.
        Forget their hashes, and preempt every running request that holds one: it may have read
        them this step, and then wrote wrong KV entries of its own, so its blocks are suspect
        too (transitively). Conservative: a request sharing only older, sound blocks with the
        failed one is recomputed as well; failures are rare, wrong outputs are not an option."""
        suspect = set(blocks)
        readers = [r for r in self.running if r.status == RequestStatus.RUNNING]
        while victims := [r for r in readers if suspect.intersection(self.kv_cache.blocks(r.request_id))]:
            for request in victims:
                suspect.update(self.kv_cache.blocks(request.request_id))
                self._preempt(request)  # its token of this step, if any, is dropped: recomputed
                self._preempted_ids.append(request.request_id)
                readers.remove(request)
        self.kv_cache.uncache(suspect)

    def _apply_stop_rules(self, request: Request, token_id: int) -> None:
        sampling = request.sampling
        may_stop = request.num_output_tokens >= sampling.min_tokens
        if may_stop and not sampling.ignore_eos and token_id in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif may_stop and sampling.stop_token_ids and token_id in sampling.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id
        elif sampling.max_tokens is not None and request.num_output_tokens >= sampling.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
        elif request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH

    def _release(self, request: Request) -> None:
        """Forget a finished request: free its blocks, tell the workers if they hold it."""
        self.kv_cache.free(request.request_id)
        self._release_images(request)
        if request.on_workers:
            self._finished_ids.append(request.request_id)
        del self.requests[request.request_id]


_GRAMMAR_REJECTED = "structured_outputs: the sampled token does not follow the grammar"


def _logprobs_rows(logprobs: TokenLogprobs | None, first: int, count: int, num_top: int | None) -> TokenLogprobs | None:
    if logprobs is None or num_top is None:
        return None
    return logprobs.rows(first, count, num_top)


def _rows_by_request(request_ids: list[str]) -> list[tuple[str, range]]:
    """The answer's rows grouped into each request's run of consecutive rows."""
    runs: list[tuple[str, range]] = []
    start = 0
    for row in range(1, len(request_ids) + 1):
        if row == len(request_ids) or request_ids[row] != request_ids[start]:
            runs.append((request_ids[start], range(start, row)))
            start = row
    return runs
