"""`LLM`: vLLM's offline API — batch generation and chat over a whole list of prompts.

It assembles its engine (`LLMEngine.from_engine_args`: an engine core and workers in this process,
or engine-core processes), which is launcher work; generating goes through the frontend's
request loop (zllm/frontend/llm_engine.py)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec
import numpy as np
from tqdm.auto import tqdm

from zllm.config import runs_on_cuda
from zllm.frontend.multimodal import chat_images
from zllm.frontend.processor import PromptType
from zllm.frontend.tokenizer import Messages, batch_token_ids, chat_prompt
from zllm.ipc.messages import AddPoolingBatch, AddRequest
from zllm.launch.llm_engine import LLMEngine
from zllm.lora import LoRARequest
from zllm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from zllm.pooling import POOLING_SAMPLING, PoolingParams, cosine, finish_pooled, finished_rows
from zllm.procs.gc_heap import freeze_startup_heap, old_generation_deferred, thaw_heap
from zllm.sampling_params import SamplingParams

# Text inputs per tokenizer call when pooling: the engine embeds one chunk while the next is tokenized.
_TOKENIZE_CHUNK = 1024


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a pooling batch is built and run: 10,000 inputs
    allocate ~100,000 objects that all stay alive until the batch ends, so the collector's passes
    find nothing and cost a quarter of an embedding batch's host time. Whatever cycles arise
    are collected once it is back on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class LLM:
    """Generate completions offline.

    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0))
    print(outs[0].outputs[0].text)
    """

    def __init__(
        self,
        model: str | None = None,
        tokenizer: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        **engine_args: Any,
    ) -> None:
        self.engine = LLMEngine.from_engine_args(
            model,
            tokenizer=tokenizer,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len or 0,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            **engine_args,
        )
        self._ids = itertools.count()
        # The engine core (and at tp 1 the worker) runs in this process, so the model's modules,
        # torch and the tokenizer join this heap: every full collection walked them, pausing
        # generation ~250 ms each time (4 pauses in W1 on an H200, 5% of its time;
        # docs/benchmarks.md). Frozen out of the walks now, thawed when the engine shuts down.
        # On a CPU a step takes long enough that the pauses hardly count, and the freeze's own
        # full collection (~0.4 s in a heap of 2.7M objects) would not pay for itself.
        thaw = runs_on_cuda(self.engine.config) and freeze_startup_heap("LLM") > 0
        # Worker (tp > 1) and engine-core (dp > 1) processes stop with the LLM, or at interpreter exit at the latest.
        self._finalizer = weakref.finalize(self, _shut_down, self.engine, thaw)

    def shutdown(self) -> None:
        """Stop the engine and any worker processes; the LLM cannot generate afterwards."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the prompts' order. `priority` (one per
        prompt, lower first) needs scheduling_policy="priority"; a prompt dict may carry a
        "cache_salt" that keeps its prefix-cache entries apart from other salts. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model; needs
        enable_lora=True)."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = self._priorities(priority, len(prompt_list))
        loras = self._loras(lora_request, len(prompt_list))
        request_ids = self._add_all(prompt_list, params, priorities, loras)
        return self._run(request_ids, use_tqdm)

    # ---- pooling models (embeddings, classifiers, cross-encoders) ----------------------------------

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (normalized as the model declares, unless pooling_params say).
        truncate_prompt_tokens (vLLM's): each input's last k tokens; -1: max_model_len."""
        params = _truncated(pooling_params or PoolingParams(), truncate_prompt_tokens)
        pooled = self._pool(self._prompt_list(prompts), _with_task(params, "embed"), use_tqdm)
        return [EmbeddingRequestOutput(i, EmbeddingOutput(row), ids) for i, ids, row in pooled.rows()]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (softmax over the labels; sigmoid for one label)."""
        params = PoolingParams(task="classify", truncate_prompt_tokens=truncate_prompt_tokens)
        pooled = self._pool(self._prompt_list(prompts), params, use_tqdm)
        return [ClassificationRequestOutput(i, ClassificationOutput(row), ids) for i, ids, row in pooled.rows()]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """The raw pooled vector per prompt (the pooled hidden state, or the classifier's logits)."""
        params = _truncated(pooling_params or PoolingParams(task="encode"), truncate_prompt_tokens)
        pooled = self._pool(self._prompt_list(prompts), params, use_tqdm)
        return [PoolingRequestOutput(i, PoolingOutput(row), ids) for i, ids, row in pooled.rows()]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """The relevance of each pair (one text against many, or pairwise): a cross-encoder reads
        the pair as one input (truncate_prompt_tokens: its joined tokens' last k); an embedding
        model scores the cosine of the two embeddings (each text truncated)."""
        firsts, seconds = score_pairs(data_1, data_2)
        pooler = self.engine.config.pooler
        if pooler is not None and pooler.kind == "classify":
            pairs = self.engine.processor.tokenize_pairs(firsts, seconds, truncate_prompt_tokens)
            pooled = self._pool(
                pairs, PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens), use_tqdm
            )
            scores = [float(row[0]) for row in pooled.vectors]
            ids = pooled.prompt_token_ids
        else:
            params = PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
            pooled = self._pool([*firsts, *seconds], params, use_tqdm)
            count, tokens = len(firsts), pooled.prompt_token_ids
            vectors = [v if isinstance(v, list) else v.tolist() for v in pooled.vectors]
            scores = [cosine(a, b) for a, b in zip(vectors[:count], vectors[count:])]
            ids = [a + b for a, b in zip(tokens[:count], tokens[count:])]
        return [
            ScoringRequestOutput(str(i), ScoringOutput(score), tokens)
            for i, (score, tokens) in enumerate(zip(scores, ids))
        ]

    def _tokenized_together(self, prompts: list[PromptType]) -> list[PromptType]:
        """The text prompts as {"prompt", "prompt_token_ids"} dicts, tokenized in one call."""
        ids = self._token_ids_of(prompts)
        return [
            p if t is None else ({**p} if isinstance(p, dict) else {"prompt": p}) | {"prompt_token_ids": t}
            for p, t in zip(prompts, ids)
        ]

    def _token_ids_of(self, prompts: list[PromptType]) -> list[list[int] | None]:
        """Each text prompt's token ids, tokenized in one call (the tokenizer's batch path runs in
        parallel): many short inputs are a pooling model's usual load; None for the others (token
        ids, an empty text: the processor checks them). Every text is tokenized here, on the
        tokenizer thread: the engine's thread must not use the tokenizer at the same time."""
        tokenizer = self.get_tokenizer()
        texts = [_text_of(p) for p in prompts]
        wanted = [t for t in texts if t]
        if tokenizer is None or not wanted:
            return [None] * len(prompts)
        ids = iter(batch_token_ids(tokenizer, wanted))
        return [next(ids) if t else None for t in texts]

    @staticmethod
    def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if not prompt_list:
            raise ValueError("prompts: must not be empty")
        return prompt_list

    def _pool(self, prompts: list[PromptType], params: PoolingParams, use_tqdm: bool) -> _PooledBatch:
        """Validate every input, run them through the engine core, then finish all vectors in
        one vectorized pass. The output processor (detokenizers, per-token state) has nothing to
        do for a pooling request, so the core's answers are read directly. Plain inputs (text or
        token ids) travel as pooling batches (one unit per chunk: no Request per input); others
        (a text pair's token types, images) one request each."""
        with _collector_paused():
            if self._batchable(prompts):
                return self._pool_batches(prompts, params, use_tqdm)
            return self._pool_all(prompts, params, use_tqdm)

    def _batchable(self, prompts: list[PromptType]) -> bool:
        """Whether the inputs can go as pooling batches: an in-process core (not data-parallel
        engine processes), and inputs that are text or token ids with nothing else."""
        if not hasattr(self.engine.core, "add_pooling_batch"):
            return False
        return all(isinstance(p, str) or (isinstance(p, dict) and p.keys() <= _PLAIN_KEYS) for p in prompts)

    @staticmethod
    def _tokenizing(prompts: list[PromptType], executor: ThreadPoolExecutor, tokenize: Callable) -> deque:
        """Each chunk of the prompts, tokenized on the helper thread: (first index, future)."""
        return deque(
            (start, executor.submit(tokenize, prompts[start : start + _TOKENIZE_CHUNK]))
            for start in range(0, len(prompts), _TOKENIZE_CHUNK)
        )

    def _pool_batches(self, prompts: list[PromptType], params: PoolingParams, use_tqdm: bool) -> _PooledBatch:
        """Each tokenized chunk becomes one AddPoolingBatch (checked once, admitted whole); its
        vectors come back as arrays, finished together at the end."""
        processor = self.engine.processor
        batches: list[tuple[AddPoolingBatch, list[list[int]]]] = []
        with ThreadPoolExecutor(1, thread_name_prefix="zllm-tokenize") as tokenizer_thread:
            tokenizing = self._tokenizing(prompts, tokenizer_thread, self._token_ids_of)

            def next_batch(wait: bool) -> AddPoolingBatch | None:
                """The next tokenized chunk as a pooling batch; None if none is ready (or left)."""
                if not tokenizing or not (wait or tokenizing[0][1].done()):
                    return None
                start, future = tokenizing.popleft()
                given = prompts[start : start + _TOKENIZE_CHUNK]
                batch = processor.process_pooling_batch(f"batch-{next(self._ids)}", given, future.result(), params)
                batches.append(batch)
                return batch[0]

            try:
                vectors = self._run_pooling_batches(next_batch, len(prompts), use_tqdm)
            finally:
                for _, future in tokenizing:
                    future.cancel()
        matrix = np.concatenate([vectors[message.batch_id] for message, _ in batches])
        # Rows of one array: each becomes a list when its output is read (zllm/outputs.py).
        rows = list(finished_rows(matrix, params, self.engine.config.pooler))
        request_ids = list(map(str, itertools.islice(self._ids, len(rows))))
        return _PooledBatch(request_ids, [ids for _, chunk in batches for ids in chunk], rows)

    def _run_pooling_batches(
        self, next_batch: Callable[[bool], AddPoolingBatch | None], total: int, use_tqdm: bool
    ) -> dict[str, np.ndarray]:
        """Feed the core batches (one more whenever its queue has room: the core refuses a batch
        while max_waiting inputs wait unscheduled) and step it until every input has its vector."""
        core = self.engine.core
        pending: deque[AddPoolingBatch] = deque()
        vectors: dict[str, np.ndarray] = {}
        sizes: dict[str, int] = {}  # batch id -> its inputs
        unanswered: dict[str, int] = {}  # batch id -> its inputs still without a vector
        done = 0
        with tqdm(total=total, desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while done < total:
                    if not pending:
                        batch = next_batch(not unanswered)
                        pending.extend([batch] if batch is not None else [])
                    while pending and self._queued(core, pending[0]):
                        batch = pending.popleft()
                        unanswered[batch.batch_id] = sizes[batch.batch_id] = batch.lengths.shape[0]
                    core.step()
                    for answer in core.take_pooled_slices():
                        if answer.batch_id not in unanswered:
                            continue
                        if answer.error is not None or answer.vectors is None:
                            raise RuntimeError(f"the engine failed pooling batch {answer.batch_id}: {answer.error}")
                        rows = answer.vectors.to_numpy()
                        if answer.batch_id not in vectors:
                            vectors[answer.batch_id] = np.empty((sizes[answer.batch_id], rows.shape[1]), np.float32)
                        vectors[answer.batch_id][answer.first : answer.first + len(rows)] = rows
                        unanswered[answer.batch_id] -= len(rows)
                        if not unanswered[answer.batch_id]:
                            del unanswered[answer.batch_id]
                        done += len(rows)
                        bar.update(len(rows))
            except BaseException:
                core.abort_pooling_batches(sorted(unanswered))
                raise
        return vectors

    @staticmethod
    def _queued(core, batch: AddPoolingBatch) -> bool:
        """Whether the core took the batch now (False: its queue is full; the batch waits)."""
        from zllm.enginecore.core import QueueFullError  # the engine core loads with an engine

        try:
            core.add_pooling_batch(batch)
        except QueueFullError:
            return False
        return True

    def _pool_all(self, prompts: list[PromptType], params: PoolingParams, use_tqdm: bool) -> _PooledBatch:
        """One request per input. Text prompts are tokenized in chunks on a helper thread (the
        Rust tokenizer lets go of the GIL), so the engine embeds one chunk while the next is tokenized."""
        messages: list[AddRequest] = []
        with ThreadPoolExecutor(1, thread_name_prefix="zllm-tokenize") as tokenizer_thread:
            tokenizing = self._tokenizing(prompts, tokenizer_thread, self._tokenized_together)

            def next_messages(wait: bool) -> list[AddRequest]:
                """The next tokenized chunk as engine messages; [] if none is ready (or left)."""
                if not tokenizing or not (wait or tokenizing[0][1].done()):
                    return []
                start, future = tokenizing.popleft()
                given = prompts[start : start + _TOKENIZE_CHUNK]
                chunk = [
                    self._pooling_message(prompt, params, prompt is not g) for prompt, g in zip(future.result(), given)
                ]
                messages.extend(chunk)
                return chunk

            try:
                raw = self._run_pooling(next_messages, len(prompts), use_tqdm)
            finally:
                for _, future in tokenizing:
                    future.cancel()
        rows = finish_pooled(b"".join(raw[m.request_id] for m in messages), params, self.engine.config.pooler)
        return _PooledBatch([m.request_id for m in messages], [m.prompt_token_ids for m in messages], rows)

    def _pooling_message(self, prompt: PromptType, params: PoolingParams, tokenized: bool) -> AddRequest:
        return self.engine.processor.process(
            str(next(self._ids)), prompt, POOLING_SAMPLING, pooling=params, tokenized=tokenized
        )[0]

    def _run_pooling(
        self, next_messages: Callable[[bool], list[AddRequest]], total: int, use_tqdm: bool
    ) -> dict[str, bytes]:
        """Feed the core (at most max_waiting queued at once: an offline batch of 100,000 inputs
        would overflow its waiting queue) and step it until every input has its vector."""
        core, limit = self.engine.core, self.engine.config.max_waiting
        pending, pooled, in_engine = deque(), {}, set()
        with tqdm(total=total, desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while len(pooled) < total:
                    if len(pending) < limit:
                        pending.extend(next_messages(not pending and not in_engine))
                    while pending and len(in_engine) < limit:
                        message = pending.popleft()
                        core.add_request(message)
                        in_engine.add(message.request_id)
                    for delta in core.step():
                        if delta.finish_reason is None or delta.request_id not in in_engine:
                            continue
                        in_engine.discard(delta.request_id)
                        if delta.pooled is None:
                            raise RuntimeError(f"the engine failed pooling request {delta.request_id}: {delta.error}")
                        pooled[delta.request_id] = delta.pooled
                        bar.update(1)
            except BaseException:
                core.abort_requests(sorted(in_engine))
                raise
        return pooled

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: later requests recompute their prompts."""
        return self.engine.reset_prefix_cache()

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of messages) or several, through the chat template;
        chat_template_kwargs are extra template variables (vLLM's), e.g. {"enable_thinking": False}."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            conversation, images = chat_images(conversation, self.engine.processor.images)
            prompt = chat_prompt(
                tokenizer, conversation, add_generation_prompt, chat_template, template_kwargs=chat_template_kwargs
            )
            prompts.append({**prompt, "multi_modal_data": {"image": images}} if images else prompt)
        return self.generate(prompts, sampling_params, use_tqdm)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"sampling_params: got {len(params)} for {count} prompts; pass one, or one per prompt")
        return params

    @staticmethod
    def _priorities(priority: Sequence[int] | None, count: int) -> list[int]:
        if priority is None:
            return [0] * count
        priorities = list(priority)
        if len(priorities) != count:
            raise ValueError(f"priority: got {len(priorities)} for {count} prompts; pass one per prompt")
        return priorities

    @staticmethod
    def _loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int) -> list:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * count
        loras = list(lora_request)
        if len(loras) != count:
            raise ValueError(f"lora_request: got {len(loras)} for {count} prompts; pass one, or one per prompt")
        return loras

    def _add_all(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priorities: list[int],
        loras: list[LoRARequest | None] | None = None,
    ) -> list[str]:
        # Validate everything first: a bad prompt must not leave half the batch queued.
        loras = loras or [None] * len(prompts)
        processed = [
            self.engine.processor.process(str(next(self._ids)), prompt, sampling, priority=priority, lora_request=lora)
            for prompt, sampling, priority, lora in zip(prompts, params, priorities, loras)
        ]
        submitted = []
        try:
            for message, text in processed:
                self.engine.submit(message, text)
                submitted.append(message.request_id)
        except ValueError:
            self.engine.abort_request(submitted)  # the engine core refused one: queue none
            raise
        return [message.request_id for message, _ in processed]

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with (
            old_generation_deferred(),
            tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar,
        ):
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _shut_down(engine: LLMEngine, thaw: bool) -> None:
    """Stop the engine; first give the frozen heap back to the collector, so that the engine's
    objects caught in reference cycles (and their device memory) can be freed with it."""
    if thaw:
        thaw_heap()
    engine.shutdown()


def _text_of(prompt: PromptType) -> str | None:
    """The text of a prompt still to be tokenized: a string, or a dict with "prompt" alone."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


class _PooledBatch(NamedTuple):
    """A pooling call's results, in the inputs' order: ids, token ids and finished vectors."""

    request_ids: list[str]
    prompt_token_ids: list[list[int]]
    vectors: list  # each a list of floats, or a row of the batch's finished array

    def rows(self) -> Iterator[tuple[str, list[int], Any]]:
        return zip(self.request_ids, self.prompt_token_ids, self.vectors)


# A prompt dict with only these keys is plain text or token ids: it can travel in a pooling batch.
_PLAIN_KEYS = {"prompt", "prompt_token_ids"}


def _with_task(params: PoolingParams, task: str) -> PoolingParams:
    if params.task == task:
        return params
    return PoolingParams(
        task=task,
        normalize=params.normalize,
        dimensions=params.dimensions,
        truncate_prompt_tokens=params.truncate_prompt_tokens,
    )


def _truncated(params: PoolingParams, truncate_prompt_tokens: int | None) -> PoolingParams:
    """The call's truncate_prompt_tokens (as vLLM's LLM takes it) over the params' own."""
    if truncate_prompt_tokens is None:
        return params
    return msgspec.structs.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one text against each of the others, or the two lists pairwise."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if not firsts or not seconds:
        raise ValueError("data: the texts to score must not be empty")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"data: {len(firsts)} first texts for {len(seconds)} second texts; give one, or as many")
    return firsts, seconds
