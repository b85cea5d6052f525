"""The model runner: keeps the persistent batch, turns a StepInput into tensors, runs the model.

The engine core sends each request in full once and then only diffs (new tokens, new blocks), so
the runner keeps every live request's tokens and block table between steps.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from zllm.config import EngineConfig
from zllm.ipc.messages import CachedRequestData, NewRequestData, StepInput, StepOutput, TokenLogprobs
from zllm.partition import head_shards
from zllm.sampling_params import SamplingParams
from zllm.workers.attention import AttentionMetadata
from zllm.workers.distributed import TensorParallel
from zllm.workers.loader import init_dummy_weights, load_safetensors
from zllm.workers.models import build_model
from zllm.workers.models.spec import ModelSpec
from zllm.workers.ops import ops_for
from zllm.workers.request_failures import RequestFailures
from zllm.workers.sampler import LogprobsTensors, compute_logprobs, sample
from zllm.workers.sampling_batch import SamplingBatch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_GIB = 1 << 30


class OutOfDeviceMemory(RuntimeError):
    """The model or its KV cache does not fit; the message has the numbers."""


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_len: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams
    row: int = -1  # in the sampling batch
    # Prompt logprobs computed so far (chunked prefill); None once sent, or when not wanted.
    prompt_logprobs: list[LogprobsTensors] | None = None


@dataclass(slots=True)
class PromptSpan:
    """Positions of a request's prompt computed this step whose next prompt token is known."""

    state: RequestState
    first_index: int  # into the step's hidden states
    first_position: int
    count: int


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    logits_indices: torch.Tensor  # the last token of each request that samples this step
    sampling_states: list[RequestState]
    prompt_spans: list[PromptSpan] = field(default_factory=list)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None = None) -> torch.dtype:
    """The serving dtype. "auto": float32 on CPU; on a GPU the checkpoint's half-precision dtype,
    and bfloat16 for float32 (or unspecified) checkpoints, as vLLM does."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES[checkpoint_dtype] if checkpoint_dtype in ("float16", "bfloat16") else torch.bfloat16


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.device = device
        self.tp = tp or TensorParallel()
        self.spec = ModelSpec.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, device, self.spec.checkpoint_dtype)
        heads = head_shards(self.spec.num_heads, self.spec.num_kv_heads, self.tp.size)[self.tp.rank]
        self.num_heads = heads.q_heads.count  # on this rank
        self.num_kv_heads = heads.kv_heads.count
        self.block_size = config.block_size
        self.ops = ops_for(device)
        self.is_cuda = device.type == "cuda"
        # The CUDA kernels take int32 block tables; torch indexing takes int64.
        self.index_dtype = torch.int32 if self.is_cuda else torch.long
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, RequestState] = {}
        self.sampling = SamplingBatch(config.max_num_seqs, self.spec.vocab_size, device)
        self.awaiting_prompt_logprobs: dict[str, RequestState] = {}  # prefill not done yet
        self.failures = RequestFailures()  # new requests this worker could not take, until reported
        self.graphs = None

    # ---- set-up --------------------------------------------------------------------------------

    def load_model(self) -> None:
        try:
            with _default_dtype(self.dtype), torch.device(self.device):
                model = build_model(self.spec, self.ops, self.tp)
            if self.config.load_format == "dummy":
                init_dummy_weights(model, self.config.seed)
            else:
                load_safetensors(model, self.config.model)
        except torch.cuda.OutOfMemoryError:
            raise OutOfDeviceMemory(self._weights_do_not_fit()) from None
        self.model = model.eval()

    def _weights_do_not_fit(self) -> str:
        spec = self.spec
        params = spec.num_layers * (
            spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
            + spec.num_heads * spec.head_dim * spec.hidden_size
            + 3 * spec.hidden_size * spec.intermediate_size
        ) + spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
        free, total = torch.cuda.mem_get_info(self.device)
        return (
            f"rank {self.tp.rank}: model weights need about {params * self.dtype.itemsize / _GIB:.1f} GiB in "
            f"{self.dtype} ({params * self.dtype.itemsize / self.tp.size / _GIB:.1f} GiB per rank at tp "
            f"{self.tp.size}), but only {free / _GIB:.1f} GiB of {total / _GIB:.1f} GiB are free on {self.device}"
        )

    def kv_cache_bytes_per_block(self) -> int:
        per_token = 2 * self.spec.num_layers * self.num_kv_heads * self.spec.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def determine_num_kv_blocks(self) -> int:
        if not self.is_cuda:
            return self.config.kv_cache_memory_bytes // self.kv_cache_bytes_per_block()
        return self._profile_kv_blocks()

    def _profile_kv_blocks(self) -> int:
        """Blocks that fit in gpu_memory_utilization after weights and a forward at the token budget."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        profile_kv = self._profile_forward()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - weights - profile_kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        not_torch = (total - free) - torch.cuda.memory_reserved(self.device)  # CUDA context, cuBLAS, other processes
        budget = total * self.config.gpu_memory_utilization - weights - activations - not_torch
        num_blocks = int(budget // self.kv_cache_bytes_per_block())
        logger.info(
            "memory: %.2f GiB total x %.2f; weights %.2f GiB, activation peak %.2f GiB, other %.2f GiB -> "
            "KV cache %.2f GiB (%d blocks)",
            total / _GIB, self.config.gpu_memory_utilization, weights / _GIB, activations / _GIB,
            not_torch / _GIB, max(budget, 0) / _GIB, max(num_blocks, 0),
        )
        if num_blocks < 1:
            raise OutOfDeviceMemory(
                f"no room for a KV cache: weights {weights / _GIB:.2f} GiB + activations {activations / _GIB:.2f} GiB "
                f"+ other {not_torch / _GIB:.2f} GiB exceed {self.config.gpu_memory_utilization:.0%} of "
                f"{total / _GIB:.1f} GiB; raise --gpu-memory-utilization or lower --max-num-batched-tokens"
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_forward(self) -> int:
        """Run one forward over max_num_batched_tokens prompt tokens; returns the bytes of the
        scratch KV cache it used (not an activation)."""
        tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len * self.config.max_num_seqs)
        per_request = min(tokens, self.config.max_model_len)
        blocks_per_request = -(-per_request // self.block_size)
        num_requests = -(-tokens // per_request)
        self.initialize_kv_cache(blocks_per_request * num_requests)
        step = StepInput(step_id=0, new_requests=[], cached_requests=[], scheduled_ids=[], num_scheduled_tokens=[])
        sampling = SamplingParams(temperature=0.0)
        for r in range(num_requests):
            count = min(per_request, tokens - r * per_request)
            blocks = list(range(r * blocks_per_request, (r + 1) * blocks_per_request))
            step.new_requests.append(NewRequestData(f"profile-{r}", count, [0] * count, sampling, blocks, 0))
            step.scheduled_ids.append(f"profile-{r}")
            step.num_scheduled_tokens.append(count)
        self.execute_step(step)
        self.requests.clear()
        self.sampling.clear()
        self.awaiting_prompt_logprobs.clear()
        scratch = sum(c.numel() * c.element_size() for c in self.kv_caches)
        self.kv_caches = []
        return scratch

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.spec.head_dim)
        try:
            self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.spec.num_layers)]
        except torch.cuda.OutOfMemoryError:
            raise OutOfDeviceMemory(
                f"KV cache of {num_blocks} blocks needs {num_blocks * self.kv_cache_bytes_per_block() / _GIB:.2f} GiB, "
                "more than is free"
            ) from None

    def capture_graphs(self) -> None:
        """Capture decode CUDA graphs (after the KV cache exists)."""
        if not (self.is_cuda and self.ops.supports_graphs):
            return
        self.ops.reserve_decode_workspace(
            self.config.max_num_seqs, self.num_heads, self.spec.head_dim, self.config.max_model_len, self.device
        )
        if self.config.enforce_eager:
            return
        from zllm.workers.cuda_graphs import DecodeGraphs

        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.config.max_num_seqs, max_blocks, self.block_size)
        with torch.inference_mode():
            self.graphs.capture()

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_step(self, step: StepInput) -> StepOutput:
        self._update_states(step)
        if step.is_empty:
            return StepOutput(step_id=step.step_id, request_ids=[], sampled_token_ids=[])
        batch = self._prepare_inputs(step)
        hidden = self._forward(batch)
        if batch.prompt_spans:
            self._compute_prompt_logprobs(hidden, batch.prompt_spans)
        if not batch.sampling_states:
            return StepOutput(step_id=step.step_id, request_ids=[], sampled_token_ids=[])
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if logits is None:  # not rank 0: only rank 0 samples and answers
            return StepOutput(step_id=step.step_id, request_ids=[], sampled_token_ids=[])
        meta = self.sampling.metadata([s.row for s in batch.sampling_states])
        tokens = sample(logits, meta)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = _to_message(compute_logprobs(logits, tokens, meta.max_num_logprobs))
        return StepOutput(
            step_id=step.step_id,
            request_ids=[s.request_id for s in batch.sampling_states],
            sampled_token_ids=tokens.tolist(),
            logprobs=logprobs,
            prompt_logprobs=self._finished_prompt_logprobs(),
        )

    def _compute_prompt_logprobs(self, hidden: torch.Tensor, spans: list[PromptSpan]) -> None:
        """Logprobs of each prompt token given the tokens before it, for the positions computed
        this step; kept on the request until its prefill completes."""
        indices = torch.cat([torch.arange(s.first_index, s.first_index + s.count) for s in spans]).to(self.device)
        targets = [t for s in spans for t in s.state.token_ids[s.first_position + 1 : s.first_position + 1 + s.count]]
        num_top = max(s.state.sampling.prompt_logprobs for s in spans)
        logits = self.model.compute_logits(hidden[indices])  # every rank takes part; rank 0 gets them
        if logits is None:
            return
        result = compute_logprobs(logits, torch.tensor(targets, device=self.device), num_top)
        start = 0
        for span in spans:
            rows = slice(start, start + span.count)
            span.state.prompt_logprobs.append(
                LogprobsTensors(result.token_ids[rows], result.logprobs[rows], result.ranks[rows])
            )
            start += span.count

    def _finished_prompt_logprobs(self) -> dict[str, TokenLogprobs]:
        """The prompt logprobs of the requests whose prefill completed this step."""
        done = {}
        for request_id, state in list(self.awaiting_prompt_logprobs.items()):
            if state.num_computed_tokens == len(state.token_ids):
                done[request_id] = _concat_to_message(state.prompt_logprobs)
                state.prompt_logprobs = None
                del self.awaiting_prompt_logprobs[request_id]
        return done

    def _forward(self, batch: BatchInputs) -> torch.Tensor:
        meta = batch.attention
        num_tokens = batch.input_ids.shape[0]
        if self.graphs is not None and meta.num_decodes == num_tokens and self.graphs.bucket(num_tokens):
            return self.graphs.run(batch.input_ids, batch.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, meta)

    def _update_states(self, step: StepInput) -> None:
        for request_id in (*step.finished_ids, *step.preempted_ids):
            self._discard_request(request_id)
        for new in step.new_requests:
            self.failures.admit(new, self._add_request, self._discard_request)  # a failure fails it alone
        self.failures.drop_failed(step)
        for cached in step.cached_requests:
            state = self.requests[cached.request_id]
            _apply_diff(state, cached)
            self.sampling.append_tokens(state.row, cached.new_token_ids)

    def _add_request(self, new: NewRequestData) -> None:
        state = _state_from_new(new)
        state.row = self.sampling.add(
            new.request_id, new.sampling, state.token_ids, new.prompt_len, new.eos_token_ids, new.bad_words_token_ids
        )
        self.requests[new.request_id] = state
        if state.prompt_logprobs is not None:
            self.awaiting_prompt_logprobs[new.request_id] = state

    def _discard_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.sampling.remove(request_id)
        self.awaiting_prompt_logprobs.pop(request_id, None)

    def _prepare_inputs(self, step: StepInput) -> BatchInputs:
        # Decodes (one query token) first, shortest context first: attention batches them, and
        # neighbours of similar length waste little padding.
        def decode_first(i: int) -> tuple[bool, int]:
            is_decode = step.num_scheduled_tokens[i] == 1
            return (not is_decode, self.requests[step.scheduled_ids[i]].num_computed_tokens if is_decode else 0)

        order = sorted(range(len(step.scheduled_ids)), key=decode_first)
        token_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logits_indices: list[int] = []
        sampling_states: list[RequestState] = []
        prompt_spans: list[PromptSpan] = []
        states = []
        for i in order:
            state = self.requests[step.scheduled_ids[i]]
            start, count = state.num_computed_tokens, step.num_scheduled_tokens[i]
            if state.prompt_logprobs is not None and start < state.prompt_len - 1:
                # Position p predicts prompt token p + 1; the last prompt position predicts the output.
                span_count = min(start + count, state.prompt_len - 1) - start
                prompt_spans.append(PromptSpan(state, query_start_loc[-1], start, span_count))
            token_ids.extend(state.token_ids[start : start + count])
            positions.extend(range(start, start + count))
            seq_lens.append(start + count)
            query_start_loc.append(query_start_loc[-1] + count)
            state.num_computed_tokens = start + count
            states.append(state)
            if start + count == len(state.token_ids):
                logits_indices.append(query_start_loc[-1] - 1)
                sampling_states.append(state)
        num_decodes = sum(1 for i in order if step.num_scheduled_tokens[i] == 1)
        positions_t = torch.tensor(positions, dtype=torch.long)
        block_tables = self._block_tables(states)
        attention = AttentionMetadata(
            slot_mapping=self._slot_mapping(query_start_loc, positions_t, block_tables),
            block_tables=block_tables.to(device=self.device, dtype=self.index_dtype),
            seq_lens=torch.tensor(seq_lens, dtype=self.index_dtype, device=self.device),
            seq_lens_list=seq_lens,
            query_start_loc=query_start_loc,
            num_decodes=num_decodes,
            block_size=self.block_size,
        )
        return BatchInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=self.device),
            positions=positions_t.to(self.device),
            attention=attention,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
            sampling_states=sampling_states,
            prompt_spans=prompt_spans,
        )

    def _block_tables(self, states: list[RequestState]) -> torch.Tensor:
        width = max(len(s.block_ids) for s in states)
        table = torch.zeros((len(states), width), dtype=torch.long)
        for row, state in enumerate(states):
            table[row, : len(state.block_ids)] = torch.tensor(state.block_ids, dtype=torch.long)
        return table

    def _slot_mapping(
        self, query_start_loc: list[int], positions: torch.Tensor, block_tables: torch.Tensor
    ) -> torch.Tensor:
        query_lens = torch.tensor(query_start_loc).diff()
        rows = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
        blocks = block_tables[rows, positions // self.block_size]
        return (blocks * self.block_size + positions % self.block_size).to(self.device)


def _state_from_new(new: NewRequestData) -> RequestState:
    # Prompt logprobs only for a request that starts from its first token and has no output yet
    # (one resumed after preemption sent them already).
    fresh = new.num_computed_tokens == 0 and len(new.token_ids) == new.prompt_len
    return RequestState(
        request_id=new.request_id,
        prompt_len=new.prompt_len,
        token_ids=list(new.token_ids),
        block_ids=list(new.block_ids),
        num_computed_tokens=new.num_computed_tokens,
        sampling=new.sampling,
        prompt_logprobs=[] if new.sampling.prompt_logprobs is not None and fresh else None,
    )


def _to_message(logprobs: LogprobsTensors) -> TokenLogprobs:
    return TokenLogprobs(logprobs.token_ids.tolist(), logprobs.logprobs.tolist(), logprobs.ranks.tolist())


def _concat_to_message(parts: list[LogprobsTensors]) -> TokenLogprobs:
    if not parts:  # a one-token prompt has no prompt logprobs
        return TokenLogprobs([], [], [])
    return _to_message(
        LogprobsTensors(
            torch.cat([p.token_ids for p in parts]), torch.cat([p.logprobs for p in parts]), torch.cat([p.ranks for p in parts])
        )
    )


def _apply_diff(state: RequestState, diff: CachedRequestData) -> None:
    state.token_ids.extend(diff.new_token_ids)
    state.block_ids.extend(diff.new_block_ids)
    state.num_computed_tokens = diff.num_computed_tokens


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters directly in the serving dtype (no float32 copy of a large model)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
