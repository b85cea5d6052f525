"""Structured outputs in the engine core: grammars compiled off the busy loop, a matcher per
request that takes each token the request is given, and each step's bitmask.

    AddRequest (structured_outputs) --> compile in a thread, once per spec (cached)
    compiled --> the request's matcher (taking its tokens so far: a resumed request has some)
    a step samples the request --> its bitmask row: the tokens the grammar allows next
    the token arrives --> matcher.accept_token

With `starts_after` (a reasoning model's end-of-thinking tokens) the grammar sleeps, allowing
every token, until the output has written those tokens; the answer after them is constrained.

The busy loop never waits for a compile: a request whose grammar is not ready stays waiting
(the scheduler passes over it) and the others run. xgrammar, the tokenizer and their torch
import are loaded in the compile thread with the first constrained request.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zllm.config import EngineConfig
from zllm.grammars import grammar_of, xgrammar
from zllm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_ALL_ALLOWED = -1  # an int32 word with every bit set


@dataclass(slots=True, eq=False)
class RequestGrammar:
    """One request's grammar: compiling, then matching."""

    compiled: Future  # of an xgrammar CompiledGrammar
    matcher: Any = None  # xgrammar GrammarMatcher, once compiled and started
    starts_after: list[int] | None = None  # asleep until the output has written these tokens
    _tail: list[int] = field(default_factory=list)  # the last tokens seen while asleep

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None

    @property
    def is_awake(self) -> bool:
        return self.starts_after is None

    @property
    def is_active(self) -> bool:
        """It constrains the next token: awake, and not terminated (a terminated grammar accepted
        its stop token)."""
        return self.is_awake and self.matcher is not None and not self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it."""
        if not self.is_awake:
            self._wake_after(token_id)
            return True
        return not self.is_active or self.matcher.accept_token(token_id)

    def _wake_after(self, token_id: int) -> None:
        gate = self.starts_after
        self._tail = (self._tail + [token_id])[-len(gate) :]
        if self._tail == gate:
            self.starts_after = None  # the thinking has ended: the next token is the answer's

    def ends_sleep_at(self, drafts: list[int]) -> int | None:
        """The index of the draft that would wake the grammar (None: none would)."""
        tail = list(self._tail)
        for j, token_id in enumerate(drafts):
            tail = (tail + [token_id])[-len(self.starts_after) :]
            if tail == self.starts_after:
                return j
        return None

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The leading drafts the grammar allows (up to a stop token that ends it); the matcher
        is left where it was. Asleep, drafts run free up to the one that would wake it: the
        rows after it would need the awake grammar's bitmask, which the step's mask (computed
        asleep) lacks; the token that wakes it is then sampled free in the step's last row."""
        if not self.is_awake:
            end = self.ends_sleep_at(drafts)
            return drafts if end is None else drafts[:end]
        if not self.is_active:
            return drafts  # past its end (ignore_eos): nothing is constrained any more
        taken = 0
        for token_id in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return drafts[:taken]


@dataclass(slots=True)
class _Backend:
    compiler: Any  # xgrammar GrammarCompiler (the model's vocabulary)
    batch: Any  # xgrammar BatchGrammarMatcher: fills many rows on several threads
    words: int  # int32 words per bitmask row


class StructuredOutputs:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Several compiles at once, so that one slow schema does not hold back the others.
        self._pool = ThreadPoolExecutor(max_workers=config.grammar_threads, thread_name_prefix="grammar-compile")
        self._backend: Future | None = None
        self._backend_lock = threading.Lock()  # the first compiles race to load it
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._compiling: dict[str, tuple[Any, RequestGrammar]] = {}  # request id -> (request, grammar)

    # ---- compiling -------------------------------------------------------------------------------

    def start(self, request: Any, params: StructuredOutputsParams) -> RequestGrammar:
        """Compile (or find compiled) the request's grammar; `activate_compiled` starts its matcher."""
        grammar = RequestGrammar(self._compile(params), starts_after=params.starts_after)
        self._compiling[request.request_id] = (request, grammar)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> Future:
        spec = params.grammar_spec()
        future = self._compiled.get(spec)
        if future is not None:
            self._compiled.move_to_end(spec)
            return future
        future = self._pool.submit(self._compile_now, params)
        self._compiled[spec] = future
        while len(self._compiled) > self.config.grammar_cache_size:
            self._compiled.popitem(last=False)  # least recently used; requests keep their own
        return future

    def _compile_now(self, params: StructuredOutputsParams) -> Any:
        backend = self._loaded_backend()
        return backend.compiler.compile_grammar(grammar_of(params))

    def _loaded_backend(self) -> _Backend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = Future()
                try:
                    self._backend.set_result(self._load_backend())
                except Exception as error:
                    self._backend.set_exception(error)
        return self._backend.result()

    def _load_backend(self) -> _Backend:
        from transformers import AutoTokenizer

        xgr = xgrammar()
        vocab_size = _vocab_size(self.config.model)  # the logits' width, which a bitmask row covers
        tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        threads = min(self.config.grammar_threads, os.cpu_count() or 1)
        compiler = xgr.GrammarCompiler(info, max_threads=threads)
        logger.info("grammar engine ready: xgrammar over %d tokens, %d threads", vocab_size, threads)
        return _Backend(compiler, xgr.BatchGrammarMatcher(threads), xgr.get_bitmask_shape(1, vocab_size)[1])

    @property
    def has_compiling(self) -> bool:
        return bool(self._compiling)

    def wait_for_a_compile(self, timeout_s: float) -> None:
        """Block until some request's grammar is compiled, or the timeout (the busy loop has
        nothing else to do meanwhile)."""
        wait([grammar.compiled for _, grammar in self._compiling.values()], timeout_s, FIRST_COMPLETED)

    def activate_compiled(self) -> dict[str, str]:
        """Start the matchers of the requests whose grammar is now compiled; returns the requests
        whose grammar failed to compile, with the reason."""
        failed = {}
        for request_id, (request, grammar) in list(self._compiling.items()):
            if not grammar.compiled.done():
                continue
            del self._compiling[request_id]
            if request.status.is_finished:
                continue  # aborted meanwhile
            error = grammar.compiled.exception()
            if error is not None:
                failed[request_id] = str(error)
                continue
            grammar.matcher = self._start_matcher(grammar.compiled.result(), request)
            if not all(map(grammar.accept, request.output_token_ids)):
                failed[request_id] = "structured_outputs: the tokens it resumed with do not follow its grammar"
        return failed

    def _start_matcher(self, compiled: Any, request: Any) -> Any:
        # The request's own stop tokens (generation config + tokenizer) end the grammar.
        stop = sorted(request.eos_token_ids) or None
        return xgrammar().GrammarMatcher(compiled, override_stop_tokens=stop)

    def forget(self, request_id: str) -> None:
        self._compiling.pop(request_id, None)

    # ---- bitmasks ----------------------------------------------------------------------------------

    def bitmask(self, grammars: list[RequestGrammar | None], drafts: list[list[int]] | None = None) -> np.ndarray:
        """int32 [rows, words]: what each grammar allows next; all tokens for a request that has
        none any more (it finished or was aborted since it was scheduled). With `drafts`, a
        request has 1 + len(its drafts) rows: what it allows after each prefix of them (the
        drafts were checked against it when they arrived)."""
        backend = self._loaded_backend()
        drafts = drafts or [[] for _ in grammars]
        rows = np.full((sum(1 + len(d) for d in drafts), backend.words), _ALL_ALLOWED, dtype=np.int32)
        first_rows = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]]).tolist()
        active = [i for i, grammar in enumerate(grammars) if grammar is not None and grammar.is_active]
        plain = [i for i in active if not drafts[i]]
        if plain:
            matchers = [grammars[i].matcher for i in plain]
            backend.batch.batch_fill_next_token_bitmask(matchers, rows, [first_rows[i] for i in plain])
        for i in (i for i in active if drafts[i]):
            self._fill_along_drafts(backend, grammars[i].matcher, drafts[i], rows, first_rows[i])
        return rows

    @staticmethod
    def _fill_along_drafts(backend: _Backend, matcher: Any, drafts: list[int], rows: np.ndarray, first: int) -> None:
        """Row first + j: what the grammar allows after the first j drafts; the matcher walks the
        drafts and is rolled back to where it was."""
        taken = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():
                break  # a draft ended the grammar: the rows after it stay all-allowed (never reached)
            backend.batch.batch_fill_next_token_bitmask([matcher], rows, [first + j])
            if j < len(drafts) and matcher.accept_token(drafts[j]):
                taken += 1
        if taken:
            matcher.rollback(taken)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _vocab_size(model_dir: str) -> int:
    """From the model's config.json (plain JSON: the core imports no model code)."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
