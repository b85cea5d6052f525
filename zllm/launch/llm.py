"""`LLM`: vLLM's offline API — batch generation and chat over a whole list of prompts.

It assembles its engine (`LLMEngine.from_engine_args`: an engine core and workers in this process,
or engine-core processes), which is launcher work; generating goes through the frontend's
request loop (zllm/frontend/llm_engine.py)."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from zllm.frontend.processor import PromptType
from zllm.frontend.tokenizer import Messages, chat_prompt
from zllm.launch.llm_engine import LLMEngine
from zllm.outputs import RequestOutput
from zllm.sampling_params import SamplingParams


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
        # Worker (tp > 1) and engine-core (dp > 1) processes stop with the LLM, or at interpreter exit at the latest.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

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
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the prompts' order. `priority` (one per
        prompt, lower first) needs scheduling_policy="priority"; a prompt dict may carry a
        "cache_salt" that keeps its prefix-cache entries apart from other salts."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = self._priorities(priority, len(prompt_list))
        request_ids = self._add_all(prompt_list, params, priorities)
        return self._run(request_ids, use_tqdm)

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
        prompts = [
            chat_prompt(tokenizer, c, add_generation_prompt, chat_template, template_kwargs=chat_template_kwargs)
            for c in conversations
        ]
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

    def _add_all(self, prompts: list[PromptType], params: list[SamplingParams], priorities: list[int]) -> list[str]:
        # Validate everything first: a bad prompt must not leave half the batch queued.
        processed = [
            self.engine.processor.process(str(next(self._ids)), prompt, sampling, priority=priority)
            for prompt, sampling, priority in zip(prompts, params, priorities)
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
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
