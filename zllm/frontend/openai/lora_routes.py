"""LoRA adapters over HTTP (vLLM's routes): a request's `model` names a served adapter (the
ApiServer resolves it), /v1/models lists them beside the base model, and

    POST /v1/load_lora_adapter     {"lora_name": ..., "lora_path": ...}
    POST /v1/unload_lora_adapter   {"lora_name": ...}

load and drop adapters at run time, registered only when ZLLM_ALLOW_RUNTIME_LORA_UPDATING is on
(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): anyone who may call the API could otherwise make the
server read any directory it can see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from zllm import envs
from zllm.frontend.openai.protocol import (
    BadRequestError,
    LoadLoRAAdapterRequest,
    ModelCard,
    UnloadLoRAAdapterRequest,
    now_s,
)

if TYPE_CHECKING:
    from zllm.frontend.openai.api_server import ApiServer


class LoRARoutes:
    """The LoRA handlers of one ApiServer."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api
        self.adapters = api.frontend.processor.adapters  # None: the engine serves no adapters

    def register(self, app: web.Application) -> None:
        if self.adapters is not None and envs.ZLLM_ALLOW_RUNTIME_LORA_UPDATING:
            app.router.add_post("/v1/load_lora_adapter", self.load)
            app.router.add_post("/v1/unload_lora_adapter", self.unload)

    def serves(self, name: str) -> bool:
        return self.adapters is not None and self.adapters.resolve(name) is not None

    def cards(self) -> list[ModelCard]:
        """One model card per served adapter; its parent is the base model."""
        if self.adapters is None:
            return []
        base, max_len = self.api.config.model_name, self.api.config.max_model_len
        return [
            ModelCard(id=name, created=now_s(), root=lora.lora_path, parent=base, max_model_len=max_len)
            for name, lora in list(self.adapters.named.items())
        ]

    async def load(self, request: web.Request) -> web.Response:
        body, _ = await self.api._decode(request, LoadLoRAAdapterRequest)
        try:
            self.adapters.load(body.lora_name, body.lora_path)
        except ValueError as error:
            raise BadRequestError(str(error), "lora_path") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body, _ = await self.api._decode(request, UnloadLoRAAdapterRequest)
        try:
            self.adapters.unload(body.lora_name)
        except KeyError:
            raise _NotFoundError(f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name") from None
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


class _NotFoundError(BadRequestError):
    status = 404
