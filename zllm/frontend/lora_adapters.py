"""The adapters the frontend serves: the named ones (--lora-modules, and those loaded at run time
through /v1/load_lora_adapter) and the check of every adapter a request names before it reaches
the engine core (zllm/lora.py's checks, made once per adapter)."""

from __future__ import annotations

import itertools
import threading

from zllm.config import EngineConfig
from zllm.lora import AdapterInfo, LoRARequest, check_adapter
from zllm.model_spec import ModelSpec


class LoRAAdapters:
    def __init__(self, config: EngineConfig) -> None:
        self.enabled = config.enable_lora
        self.max_rank = config.max_lora_rank
        self.base_name = config.model_name
        self.spec = ModelSpec.from_pretrained(config.model) if self.enabled else None
        self._checked: dict[tuple[int, str], AdapterInfo] = {}
        self.named: dict[str, LoRARequest] = {}
        # Ids are given here, in one frontend, so every engine (data parallelism) sees the same.
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the HTTP loop and the offline caller may both load
        for name, path in config.lora_modules.items():
            self.load(name, path)

    def check(self, lora: LoRARequest | None) -> None:
        """ValueError unless the engine serves adapters and this one fits the base model."""
        if lora is None:
            return
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request: expected LoRARequest, got {type(lora).__name__}")
        if not self.enabled:
            raise ValueError("lora_request: this engine serves no LoRA adapters; start it with enable_lora")
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self._checked:
            self._checked[key] = check_adapter(lora.lora_path, self.spec, self.max_rank)

    def load(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` under `name` (ValueError: a bad adapter, or the name is taken)."""
        if not self.enabled:
            raise ValueError("lora: this engine serves no LoRA adapters; start it with --enable-lora")
        with self._lock:
            if not name or name == self.base_name or name in self.named:
                raise ValueError(f"lora_name: {name!r} is already served")
            request = LoRARequest(name, next(self._ids), path)
            self.check(request)
            self.named[name] = request
            return request

    def unload(self, name: str) -> None:
        """KeyError: no adapter of that name. Requests running on it finish; the workers drop it
        from their caches when it is least recently used."""
        with self._lock:
            request = self.named.pop(name)
            self._checked.pop((request.lora_int_id, request.lora_path), None)

    def resolve(self, model: str) -> LoRARequest | None:
        return self.named.get(model)
