"""Images into a vision-language model's prompt, in the frontend: the model's own image
processor from transformers resizes and normalizes them into patches, and each image placeholder
token of the prompt becomes as many tokens as the image has merged patches.

```
 prompt ids: t t <vision_start> <image_pad> <vision_end> t       1 placeholder per image
 processor:  pixel_values [patches, C*T*P*P], grid (t, h, w)    tokens = t*h*w / merge^2
 out:        t t <vision_start> <image_pad> x tokens <vision_end> t, ImageInput(hash, offset, length, ...)
```

The image's hash (SHA-256 of its pixel values and grid) keys the workers' encoder cache and the
prefix-cache hashes of its blocks, so equal images share both, whoever sent them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any

from zllm.ipc.messages import ArrayData, ImageInput
from zllm.model_spec import VisionSpec


class ImageProcessor:
    """A vision-language model's image processor and placeholder expansion."""

    def __init__(
        self,
        model_dir: str,
        vision: VisionSpec,
        processor_kwargs: dict[str, Any] | None = None,
        limit: int | None = None,
    ) -> None:
        """processor_kwargs: the engine's (--mm-processor-kwargs; a prompt's own override them);
        limit: the most images a prompt may carry (--limit-mm-per-prompt), None: no limit."""
        self.model_dir = model_dir
        self.vision = vision
        self.processor_kwargs = dict(processor_kwargs or {})
        self.limit = limit
        self._processor = None  # loaded with the first image

    @property
    def placeholder(self) -> str:
        """The text that stands for one image in a prompt (the chat API writes it per image part)."""
        return "<image>" if self.vision.kind == "llava" else "<|vision_start|><|image_pad|><|vision_end|>"

    def check_count(self, count: int) -> None:
        if self.limit is not None and count > self.limit:
            raise ValueError(
                f"multi_modal_data: {count} images, more than the {self.limit} a prompt may carry (--limit-mm-per-prompt)"
            )

    @property
    def processor(self):
        if self._processor is None:
            from transformers import AutoImageProcessor

            self._processor = AutoImageProcessor.from_pretrained(self.model_dir)
        return self._processor

    def expand(
        self, token_ids: list[int], images: Any, processor_kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder expanded, and the images as messages."""
        images = _image_list(images)
        placeholder = self.vision.image_token_id
        found = token_ids.count(placeholder)
        if found != len(images):
            raise ValueError(
                f"multi_modal_data: {len(images)} image(s) but the prompt has {found} image placeholder(s) "
                f"(token {placeholder}, e.g. <|vision_start|><|image_pad|><|vision_end|>)"
            )
        processed = iter(self._process(images, processor_kwargs))
        expanded: list[int] = []
        inputs: list[ImageInput] = []
        for token in token_ids:
            if token != placeholder:
                expanded.append(token)
                continue
            values, grid = next(processed)
            length = self.vision.tokens_of(grid)
            inputs.append(ImageInput(_image_hash(values, grid), len(expanded), length, ArrayData.of(values), grid))
            expanded.extend([placeholder] * length)
        return expanded, inputs

    def _process(self, images: list, processor_kwargs: dict[str, Any] | None):
        """Each image's pixel values and grid of patches (t, h, w)."""
        kwargs = self._pixel_limits_as_size({**self.processor_kwargs, **(processor_kwargs or {})})
        try:
            out = self.processor(images=images, return_tensors="np", **kwargs)
        except (TypeError, ValueError, OSError) as error:
            raise ValueError(f"multi_modal_data: the image processor refused the image(s): {error}") from None
        pixels = out["pixel_values"]
        if "image_grid_thw" not in out:  # LLaVA: [images, channels, height, width], a patch a token
            patch = self.vision.patch_size
            return [(values, [1, values.shape[-2] // patch, values.shape[-1] // patch]) for values in pixels]
        per_image, first = [], 0
        for grid in out["image_grid_thw"]:  # Qwen: every image's patches in one array
            grid = [int(g) for g in grid]
            patches = grid[0] * grid[1] * grid[2]
            per_image.append((pixels[first : first + patches], grid))
            first += patches
        return per_image

    def _pixel_limits_as_size(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Qwen's min_pixels / max_pixels as the processor's `size` (shortest_edge / longest_edge,
        in pixels): some transformers releases (5.17) ignore a lone max_pixels given at call time,
        and every release reads `size`."""
        if "min_pixels" not in kwargs and "max_pixels" not in kwargs:
            return kwargs
        size = getattr(self.processor, "size", None)
        edges = ("shortest_edge", "longest_edge")
        current = {edge: _size_value(size, edge) for edge in edges}
        if any(value is None for value in current.values()):
            return kwargs  # a processor without pixel limits: pass them on as given
        kwargs = dict(kwargs)
        low, high = (
            kwargs.pop("min_pixels", current["shortest_edge"]),
            kwargs.pop("max_pixels", current["longest_edge"]),
        )
        kwargs["size"] = {"shortest_edge": int(low), "longest_edge": int(high)}
        return kwargs


def _size_value(size: Any, key: str) -> Any:
    """One entry of a processor's `size` (a dict, or transformers' SizeDict)."""
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)


def _image_list(images: Any) -> list:
    from PIL import Image

    images = list(images) if isinstance(images, (list, tuple)) else [images]
    for index, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data: image {index} must be a PIL image, got {type(image).__name__}")
    return images


def _image_hash(values, grid: list[int]) -> str:
    digest = hashlib.sha256()
    digest.update(repr((str(values.dtype), grid)).encode())
    digest.update(values.tobytes())
    return digest.hexdigest()


def chat_images(messages: list[dict], images: ImageProcessor | None) -> tuple[list[dict], list]:
    """A conversation's content parts for LLM.chat: text parts joined, each image part
    ({"type": "image_url", "image_url": {"url": "data:..."}} or vLLM's {"type": "image_pil",
    "image_pil": image}) replaced by the model's placeholder; the images, in order."""
    found: list = []
    result = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            result.append(message)
            continue
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(part.get("text", ""))
                continue
            if kind not in ("image_url", "image_pil"):
                raise ValueError(f"messages: unknown content part {kind!r} (text, image_url, image_pil)")
            if images is None:
                raise ValueError("messages: image parts need a vision-language model; this one takes text only")
            if kind == "image_pil":
                found.append(part["image_pil"])
            else:
                url = (part.get("image_url") or {}).get("url", "")
                if not url.startswith("data:"):
                    raise ValueError("messages: LLM.chat takes image_url parts as data: URLs (or image_pil parts)")
                found.append(decode_image(read_data_url(url, len(found)), len(found)))
            texts.append(images.placeholder)
        result.append({**message, "content": "\n".join(texts)})
    return result, found


def decode_image(data: bytes, index: int = 0):
    """An image's bytes as a loaded RGB PIL image; a ValueError if they are not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"messages: image {index} cannot be decoded: {error}") from None


def read_data_url(url: str, index: int = 0) -> bytes:
    """The bytes of a `data:[<type>];base64,<data>` URL."""
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ValueError(f"messages: image {index}: a data URL must be data:<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"messages: image {index}: the data URL is not valid base64") from None
