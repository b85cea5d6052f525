"""A vision-language model's side of a step on the worker: the encoder cache, the image
embeddings placed over a chunk's placeholder tokens, and M-RoPE positions.

The engine core decides what the cache holds (zllm/enginecore/encoder_cache.py): each step names
the images to encode (`StepInput.encode`, request id -> image indices) and the hashes to drop
(`freed_mm_hashes`); this side only follows. A chunk of a prefill may start or end inside an
image: it reads the rows of the image's cached output that its tokens cover.

The memory profile (ModelRunner._profile_forward, on a GPU) runs with this side at its worst,
as vLLM's dummy multimodal profile run does: the cache full of the largest images a step may
encode (`ProfileImages`: the processor's largest image, as many as the cache and
--limit-mm-per-prompt allow), one of them encoded through the tower while the rest are held, then
the forward at the token budget with all of them held, its prompt tokens taking those images'
embeddings where whole images fit. So the KV cache sized after it leaves room for real images.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from zllm.config import EngineConfig
from zllm.ipc.messages import ArrayData, ImageInput, StepInput
from zllm.model_spec import VisionSpec

logger = logging.getLogger(__name__)
_PROFILE = "profile-"  # the memory profile's cache keys (no image hash starts so)
_MAX_ASPECT = 200  # Qwen's smart_resize refuses images whose sides' ratio is larger


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


@dataclass(frozen=True, slots=True)
class ProfileImages:
    """The images the memory profile holds: `count` of the largest image a prompt may carry,
    each `grid` (t, h, w) patches of pixel values `pixel_shape`, `tokens` language-model tokens."""

    grid: tuple[int, int, int]
    pixel_shape: tuple[int, ...]
    tokens: int
    count: int

    @classmethod
    def plan(cls, vision: VisionSpec, config: EngineConfig) -> ProfileImages | None:
        """From the processor's limits (its max_pixels under --mm-processor-kwargs; LLaVA: the
        tower's image_size), capped by what the core accepts (the encoder cache, max_model_len);
        as many as the cache holds, at most max_num_seqs prompts of --limit-mm-per-prompt each.
        None: no image can reach the workers."""
        limit = config.limit_mm_per_prompt.get("image")
        most = min(config.encoder_cache_tokens, config.max_model_len)
        if vision.kind == "llava":
            side = vision.image_size // vision.patch_size
            grid = (1, side, side)
            channels = (vision.in_channels, vision.image_size, vision.image_size)
        else:
            merge = vision.spatial_merge_size
            height, width = _largest_merged_grid(_max_pixels(config), vision.patch_size * merge, most)
            grid = (1, height * merge, width * merge)
            patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
            channels = (grid[1] * grid[2], patch)
        tokens = vision.tokens_of(list(grid))
        count = config.encoder_cache_tokens // tokens if tokens <= most else 0
        if limit is not None:
            count = min(count, limit * config.max_num_seqs)
        return cls(grid, channels, tokens, count) if count > 0 else None


def _max_pixels(config: EngineConfig) -> int | None:
    """Qwen's image processor's largest image in pixels (its size's longest_edge, the engine's
    --mm-processor-kwargs over the checkpoint's); None where the processor cannot be read."""
    kwargs = config.mm_processor_kwargs
    if "max_pixels" in kwargs:
        return int(kwargs["max_pixels"])
    if "longest_edge" in (kwargs.get("size") or {}):
        return int(kwargs["size"]["longest_edge"])
    try:
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(config.model)
    except (OSError, ValueError) as error:
        logger.warning("memory profile: no image processor to read (%s); the largest image is the cache's", error)
        return None
    size = getattr(processor, "size", None) or {}
    edge = size.get("longest_edge") if hasattr(size, "get") else getattr(size, "longest_edge", None)
    return int(edge or getattr(processor, "max_pixels", 0)) or None


def _largest_merged_grid(max_pixels: int | None, factor: int, most: int) -> tuple[int, int]:
    """(height, width) in merged tokens of the largest image Qwen's processor makes (smart_resize
    with sides multiples of `factor`), at most `most` tokens. Within max_pixels: the largest area
    of at most max_pixels / factor^2 tokens, the squarest of those (an image of that size is kept
    as it is). But a thin image (aspect ratio up to _MAX_ASPECT, where smart_resize refuses) keeps
    its short side at one factor however it is scaled down, so its long side may take more:
    sqrt(_MAX_ASPECT * max_pixels) / factor tokens, above max_pixels under about 200 tokens."""
    if max_pixels is None:
        return _squarest(most)
    thin = math.isqrt(_MAX_ASPECT * max_pixels) // factor
    if thin > max_pixels // factor**2:
        return 1, min(thin, most)
    return _squarest(min(most, max_pixels // factor**2))


def _squarest(tokens: int) -> tuple[int, int]:
    """(height, width) with the largest area of at most `tokens`, the squarest of those."""
    return max(((h, tokens // h) for h in range(1, math.isqrt(tokens) + 1)), key=lambda hw: (hw[0] * hw[1], hw[0]))


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
        pixels = self._pixels(image.pixel_values.to_numpy().copy())
        out = self.model.encode_image(pixels, tuple(image.grid_thw))
        if out.shape[0] != image.length:
            raise ValueError(
                f"image {image.mm_hash[:12]}: {out.shape[0]} tokens encoded, the prompt holds {image.length}"
            )
        self.num_encoded += 1
        return out

    def hold_profile_images(self, plan: ProfileImages) -> None:
        """The memory profile's images in the cache: count - 1 outputs held, then one encoded
        through the tower on top of them (its activations are the encoder's peak)."""
        rows = (plan.tokens, self.vision.out_hidden_size)
        for index in range(1, plan.count):
            self.cache[f"{_PROFILE}{index}"] = torch.zeros(rows, dtype=self.dtype, device=self.device)
        pixels = self._pixels(
            np.zeros(plan.pixel_shape, np.float32)
        )  # the processor's dtype, moved as _encode moves it
        out = self.model.encode_image(pixels, plan.grid)
        if tuple(out.shape) != rows:
            raise RuntimeError(f"memory profile: the dummy image encoded to {tuple(out.shape)}, not {rows}")
        self.cache[f"{_PROFILE}0"] = out

    @staticmethod
    def profile_spans(plan: ProfileImages, num_tokens: int) -> list[ImageInput]:
        """The profile's images placed whole, one after another, over a profile request's
        num_tokens prompt tokens, so its forward takes the image-embedding path (and M-RoPE's
        three streams) as a real one does. Read from the cache: no pixels travel."""
        empty = ArrayData.of(np.zeros(0, np.float32))
        return [
            ImageInput(f"{_PROFILE}{index % plan.count}", index * plan.tokens, plan.tokens, empty, list(plan.grid))
            for index in range(num_tokens // plan.tokens)
        ]

    def drop_profile_images(self) -> None:
        for key in [k for k in self.cache if k.startswith(_PROFILE)]:
            del self.cache[key]

    def _pixels(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(self.device, self.dtype)

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
