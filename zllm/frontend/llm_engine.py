"""The request loop a frontend runs: validate -> engine core -> detokenize -> RequestOutputs.

`LLMEngine` talks to an engine core through a small interface (add, abort, step), so the same
code drives an in-process core or engine-core processes (core_client.py). It is given its core
client, already built: assembling one is launcher work, and `zllm.LLMEngine.from_engine_args`
(zllm/launch/llm_engine.py) does it, so the frontend imports nothing above it.
"""

from __future__ import annotations

from typing import Protocol

from zllm.config import EngineConfig
from zllm.frontend.output_processor import OutputProcessor
from zllm.frontend.processor import InputProcessor, PromptType
from zllm.frontend.tokenizer import load_tokenizer
from zllm.ipc.messages import AddRequest, TokenDelta
from zllm.lora import LoRARequest
from zllm.outputs import RequestOutput
from zllm.sampling_params import SamplingParams


class EngineCoreClient(Protocol):
    def add_request(self, message: AddRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> list[str]: ...

    def step(self) -> list[TokenDelta]: ...

    def reset_prefix_cache(self) -> bool: ...

    def shutdown(self) -> None: ...


class LLMEngine:
    def __init__(self, config: EngineConfig, core: EngineCoreClient) -> None:
        self.config = config
        self.core = core
        self.tokenizer = load_tokenizer(config.tokenizer_path, config.skip_tokenizer_init)
        self.processor = InputProcessor.from_config(config, self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer, config.pooler)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and enqueue; raises ValueError (naming the field) and changes nothing on bad input.
        A prompt dict may carry a "cache_salt" (as in vLLM)."""
        message, text = self.processor.process(
            request_id, prompt, sampling_params, arrival_time, priority, lora_request=lora_request
        )
        self.submit(message, text)

    def submit(self, message: AddRequest, prompt_text: str | None) -> None:
        """Enqueue a request that `processor.process` already validated (n > 1: its n children).
        If the engine core refuses it (e.g. it could never fit), nothing stays queued."""
        added = []
        try:
            for core_message in self.outputs.add_request(message, prompt_text):
                self.core.add_request(core_message)
                added.append(core_message.request_id)
        except ValueError:
            self.core.abort_requests(added)
            self.outputs.abort(message.request_id)
            raise

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        core_ids = [core_id for rid in request_ids for core_id in self.outputs.core_request_ids(rid)]
        self.core.abort_requests(core_ids)
        return [out for rid in request_ids if (out := self.outputs.abort(rid)) is not None]

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.outputs.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests it advanced."""
        outputs, to_abort = self.outputs.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def shutdown(self) -> None:
        self.core.shutdown()
