"""A vision-language model's side of a step on the worker: the encoder cache, the image
embeddings placed over a chunk's placeholder tokens, and M-RoPE positions.

The engine core decides what the cache holds (zllm/enginecore/encoder_cache.py): each step names
the images to encode (`StepInput.encode`, request id -> image indices) and the hashes to drop
(`freed_mm_hashes`); this side only follows. A chunk of a prefill may start or end inside an
image: it reads the rows of the image's cached output that its tokens cover.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from zllm.ipc.messages import ImageInput, StepInput
from zllm.model_spec import VisionSpec


@dataclass(slots=True)
class MRopeState:
    """A request's prompt positions on the three streams, and what later positions add."""

    positions: np.ndarray  # [3, prompt_len]
    delta: int


@dataclass(slots=True)
class Chunk:
    """One request's tokens in the step: positions [start, end) at rows [first_row, ...)."""

    request_id: str
    images: list[ImageInput]
    mrope: MRopeState | None
    start: int
    end: int
    first_row: int


class MultimodalRunner:
    def __init__(self, model, vision: VisionSpec, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.vision = vision
        self.device = device
        self.dtype = dtype
        self.cache: dict[str, torch.Tensor] = {}  # image hash -> its encoder output [tokens, hidden]
        self.num_encoded = 0  # images this worker encoded (tests and logs)

    def mrope_of(self, token_ids: list[int], prompt_len: int, images: list[ImageInput]) -> MRopeState | None:
        from zllm.workers.models.qwen2_vl import mrope_positions

        if not images or not self.vision.uses_mrope:
            return None
        spans = [(image.offset, image.length, tuple(image.grid_thw)) for image in images]
        positions, delta = mrope_positions(token_ids[:prompt_len], spans, self.vision.spatial_merge_size)
        return MRopeState(positions, delta)

    def update_cache(self, step: StepInput, images_of) -> None:
        """Drop what the core evicted, then encode what the step needs. images_of(request id):
        that request's images, None when this worker dropped it (it failed here)."""
        for mm_hash in step.freed_mm_hashes:
            self.cache.pop(mm_hash, None)
        for request_id, indices in step.encode.items():
            images = images_of(request_id)
            if images is None:
                continue
            for index in indices:
                image = images[index]
                if image.mm_hash not in self.cache:
                    self.cache[image.mm_hash] = self._encode(image)

    def _encode(self, image: ImageInput) -> torch.Tensor:
        pixels = torch.from_numpy(image.pixel_values.to_numpy().copy()).to(self.device, self.dtype)
        out = self.model.encode_image(pixels, tuple(image.grid_thw))
        if out.shape[0] != image.length:
            raise ValueError(
                f"image {image.mm_hash[:12]}: {out.shape[0]} tokens encoded, the prompt holds {image.length}"
            )
        self.num_encoded += 1
        return out

    def embeddings(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's tokens, their image embeddings) for every image token in the step."""
        rows, parts = [], []
        for chunk in chunks:
            for image in chunk.images:
                first, last = max(chunk.start, image.offset), min(chunk.end, image.offset + image.length)
                if first >= last:
                    continue
                cached = self.cache.get(image.mm_hash)
                if cached is None:
                    raise RuntimeError(f"request {chunk.request_id}: image {image.mm_hash[:12]} is not encoded")
                rows.append(np.arange(first, last) - chunk.start + chunk.first_row)
                parts.append(cached[first - image.offset : last - image.offset])
        if not parts:
            return None
        index = torch.from_numpy(np.concatenate(rows)).to(self.device)
        return index, torch.cat(parts)

    @staticmethod
    def rope_positions(chunks: list[Chunk], positions: np.ndarray) -> np.ndarray:
        """The rotary positions of the step's tokens: 1-D where every stream agrees (text, and
        past each prompt: index + delta), else [3, tokens]."""
        rope = positions.copy()
        in_prompt = []
        for chunk in chunks:
            if chunk.mrope is None:
                continue
            prompt_len = chunk.mrope.positions.shape[1]
            past = max(chunk.start, prompt_len) - chunk.start + chunk.first_row
            rope[past : chunk.end - chunk.start + chunk.first_row] += chunk.mrope.delta
            if chunk.start < prompt_len:
                in_prompt.append((chunk, min(chunk.end, prompt_len)))
        if not in_prompt:
            return rope
        streams = np.broadcast_to(rope, (3, len(rope))).copy()
        for chunk, stop in in_prompt:
            streams[:, chunk.first_row : chunk.first_row + stop - chunk.start] = chunk.mrope.positions[
                :, chunk.start : stop
            ]
        return streams
