"""Qwen2-VL and Qwen2.5-VL: a vision transformer whose merged patches replace the image
placeholder tokens of the prompt, and the Qwen2 decoder rotating by M-RoPE positions.

```
 pixel_values [patches, C*T*P*P] --patch_embed (Conv3d)--> blocks (2-D rotary, attention within
 each frame, or within windows: Qwen2.5-VL) --merger (merge_unit patches -> one token)--> [tokens, hidden]
 prompt: text ... <vision_start> <image_pad> x tokens <vision_end> ... text
 positions: 3 streams (t, h, w): text tokens count up on all three; an image's tokens take
 (start, start + row, start + column); the text after it starts at start + max(rows, columns)
```

Images are encoded one at a time (each attends only to itself, so batching changes nothing but
speed). The vision tower is tensor-parallel like the decoder: each rank holds its heads' q/k/v
rows and its slice of the MLP, and the attention output and MLP projections end in an all-reduce
(a tower whose heads do not divide by the ranks is replicated); patch embedding and merger are
replicated. The rotary frequency pair j
of the language model rotates by stream `stream[j]` (HF's mrope_section: the first sections[0]
pairs by t, the next sections[1] by h, the last by w); where the three streams agree (text, and
every decode) the plain rotary of 1-D positions applies, so decode steps and CUDA graphs are
those of the text model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from zllm.model_spec import ModelSpec, VisionSpec
from zllm.partition import even_split
from zllm.quantization import QuantSpec
from zllm.workers.attention import UNSCALED, AttentionMetadata, KVScales
from zllm.workers.distributed import TensorParallel
from zllm.workers.layers import apply_rotary
from zllm.workers.models.llama import LlamaForCausalLM, Rotary
from zllm.workers.ops import TorchOps
from zllm.workers.parallel_layers import ColumnParallelLinear, FusedPart, RowParallelLinear


class MRotary(Rotary):
    """Rotary over 1-D positions [tokens] (the streams agree) or M-RoPE's [3, tokens]."""

    def __init__(self, spec: ModelSpec, ops: TorchOps, max_model_len: int | None = None) -> None:
        super().__init__(spec, ops, max_model_len)
        sections = spec.vision.mrope_section
        stream = [i % 3 for i, count in enumerate(sections) for _ in range(count)]
        if len(stream) != self.cos.shape[1]:
            raise ValueError(f"model: mrope_section {list(sections)} must add up to {self.cos.shape[1]} (head_dim / 2)")
        self.register_buffer("stream", torch.tensor(stream, dtype=torch.long), persistent=False)
        self.register_buffer("pair", torch.arange(len(stream)), persistent=False)

    def apply_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales = UNSCALED,
    ) -> torch.Tensor:
        if positions.dim() == 1:
            return super().apply_and_cache(positions, q, k, v, kv_cache, slot_mapping, kv_scales)
        # Each token's own cos/sin rows, then the rotary kernel indexes them by token.
        index = positions[self.stream]  # [pairs, tokens]: the stream each pair rotates by
        cos = self.cos[index, self.pair[:, None]].T.contiguous()
        sin = self.sin[index, self.pair[:, None]].T.contiguous()
        rows = torch.arange(positions.shape[1], device=positions.device, dtype=positions.dtype)
        return self.ops.rotary_and_write_kv(rows, q, k, v, cos, sin, kv_cache, slot_mapping, kv_scales)


# ---- the vision transformer (HF's parameter names) ------------------------------------------------


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _norm(v: VisionSpec, dim: int) -> nn.Module:
    return VisionRMSNorm(dim) if v.kind == "qwen2_5_vl" else nn.LayerNorm(dim, eps=1e-6)


def _activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")
    raise ValueError(f"model: vision hidden_act {name!r} is not supported")


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.shape = (v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(v.in_channels, v.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


def tower_parallel(num_heads: int, tp: TensorParallel) -> TensorParallel:
    """The tensor-parallel group a vision tower shards over: the model's, or none (replicated)
    when its heads do not divide by the ranks."""
    return tp if num_heads % tp.size == 0 else TensorParallel()


def column(in_size: int, out_size: int, tp: TensorParallel, parts: int = 1) -> ColumnParallelLinear:
    """This rank's rows of a linear layer (of `parts` equal matrices stacked in the checkpoint)."""
    rows = even_split(out_size, tp.size, tp.rank)
    return ColumnParallelLinear(in_size, [FusedPart(out_size, rows)] * parts, bias=True, fused_in_checkpoint=parts > 1)


def row(in_size: int, out_size: int, tp: TensorParallel) -> RowParallelLinear:
    """This rank's input columns of a linear layer, the partial products all-reduced."""
    return RowParallelLinear(in_size, out_size, even_split(in_size, tp.size, tp.rank), True, tp)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = num_heads // tp.size  # this rank's
        self.qkv = column(dim, dim, tp, parts=3)
        self.proj = row(dim, dim, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segments]) -> torch.Tensor:
        """Bidirectional attention within each segment (a frame, or a window)."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q = apply_rotary(q.float(), cos, sin).to(x.dtype)
        k = apply_rotary(k.float(), cos, sin).to(x.dtype)
        out = torch.empty_like(q)
        for group in segments:  # segments of one length in one batched call
            shape = (group.count, group.length, self.num_heads, q.shape[-1])
            seg = [t[group.rows].view(shape).transpose(1, 2) for t in (q, k, v)]
            out[group.rows] = F.scaled_dot_product_attention(*seg).transpose(1, 2).reshape(-1, *q.shape[1:])
        return self.proj(out.reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1, act, fc2. Qwen2.5-VL: down(act(gate) * up), with biases."""

    def __init__(self, v: VisionSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.act = _activation(v.hidden_act)
        self.gated = v.kind == "qwen2_5_vl"
        if self.gated:
            self.gate_proj = column(v.hidden_size, v.intermediate_size, tp)
            self.up_proj = column(v.hidden_size, v.intermediate_size, tp)
            self.down_proj = row(v.intermediate_size, v.hidden_size, tp)
        else:
            self.fc1 = column(v.hidden_size, v.intermediate_size, tp)
            self.fc2 = row(v.intermediate_size, v.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, v: VisionSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.norm1 = _norm(v, v.hidden_size)
        self.norm2 = _norm(v, v.hidden_size)
        self.attn = VisionAttention(v.hidden_size, v.num_heads, tp)
        self.mlp = VisionMLP(v, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segments]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.width = v.hidden_size * v.merge_unit
        self.ln_q = _norm(v, v.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, v.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, v: VisionSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.spec = v
        self.patch_embed = PatchEmbed(v)
        tp = tower_parallel(v.num_heads, tp)
        self.blocks = nn.ModuleList(VisionBlock(v, tp) for _ in range(v.depth))
        self.merger = PatchMerger(v)
        head_dim = v.hidden_size // v.num_heads
        spatial = head_dim // 2
        inv_freq = 1.0 / (v.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image (or video) of grid (t, h, w) patches: its [t*h*w / merge_unit, out_hidden] tokens."""
        v = self.spec
        t, h, w = grid
        x = self.patch_embed(pixels)
        rows, cols = _patch_coordinates(t, h, w, v.spatial_merge_size)
        device = x.device
        angles = torch.cat(
            [
                torch.as_tensor(rows, device=device)[:, None].float() * self.inv_freq,
                torch.as_tensor(cols, device=device)[:, None].float() * self.inv_freq,
            ],
            dim=-1,
        )
        cos, sin = angles.cos(), angles.sin()
        frames = segments_of(list(range(0, t * h * w + 1, h * w)), device)
        windows, order = frames, None
        if v.kind == "qwen2_5_vl":
            order, bounds = _window_order(t, h, w, v)
            windows = segments_of(bounds, device)
            patch_order = torch.as_tensor(
                (order[:, None] * v.merge_unit + np.arange(v.merge_unit)).ravel(), device=device
            )
            x, cos, sin = x[patch_order], cos[patch_order], sin[patch_order]
        for index, block in enumerate(self.blocks):
            full = v.kind != "qwen2_5_vl" or index in v.full_attention_blocks
            x = block(x, cos, sin, frames if full else windows)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.as_tensor(np.argsort(order), device=device)]
        return merged


@dataclass(slots=True)
class Segments:
    """Attention segments of one length: `count` of `length` rows each, at `rows` (in order)."""

    rows: torch.Tensor
    count: int
    length: int


def segments_of(bounds: list[int], device: torch.device) -> list[Segments]:
    """Segments bounds[i]:bounds[i + 1] grouped by length, so that each length is one batched
    attention call (Qwen2.5-VL's windows are mostly of one size)."""
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        by_length.setdefault(end - start, []).append(start)
    return [
        Segments(
            torch.as_tensor((np.asarray(starts)[:, None] + np.arange(length)).ravel(), device=device),
            len(starts),
            length,
        )
        for length, starts in by_length.items()
    ]


def _patch_coordinates(t: int, h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's (row, column), patches listed merge block by merge block as the processor
    lays them out (HF's get_vision_position_ids)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).ravel()
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).ravel()
    return np.tile(rows, t), np.tile(cols, t)


def _window_order(t: int, h: int, w: int, v: VisionSpec) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's windows: the merged tokens reordered window by window, and the windows'
    bounds in patches (HF's get_vision_window_index, for one image)."""
    merge = v.spatial_merge_size
    side = v.window_size // merge // v.patch_size  # merged tokens per window side
    gh, gw = h // merge, w // merge
    index = np.arange(t * gh * gw).reshape(t, gh, gw)
    pad_h, pad_w = side - gh % side, side - gw % side
    padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
    nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
    windows = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
    order = windows[windows >= 0]
    sizes = (windows >= 0).sum(axis=1)
    bounds = np.concatenate([[0], np.cumsum(sizes[sizes > 0]) * v.merge_unit]).tolist()
    return order, bounds


def mrope_positions(
    token_ids: list[int], images: list[tuple[int, int, tuple[int, int, int]]], merge: int
) -> tuple[np.ndarray, int]:
    """The prompt's [3, len] M-RoPE positions and the delta every later position adds to its
    index (HF's get_rope_index). images: (offset, length, grid (t, h, w)) in prompt order."""
    parts, start, current = [], 0, 0
    for offset, length, (t, h, w) in images:
        text = offset - start
        parts.append(np.broadcast_to(np.arange(text) + current, (3, text)))
        current += text
        gh, gw = h // merge, w // merge
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        parts.append(np.stack([ti.ravel(), hi.ravel(), wi.ravel()]) + current)
        current += max(gh, gw)  # an image's t is 1
        start = offset + length
    text = len(token_ids) - start
    parts.append(np.broadcast_to(np.arange(text) + current, (3, text)))
    positions = np.concatenate(parts, axis=1).astype(np.int64)
    return positions, int(positions.max()) + 1 - len(token_ids)


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """The Qwen2 decoder with M-RoPE, and the vision transformer (`visual`)."""

    def __init__(
        self,
        spec: ModelSpec,
        ops: TorchOps | None = None,
        tp: TensorParallel | None = None,
        quant: QuantSpec | None = None,
        max_model_len: int | None = None,
    ) -> None:
        ops = ops or TorchOps()
        super().__init__(spec, ops, tp, quant, max_model_len)
        self.model.rotary = MRotary(spec, ops, max_model_len)
        self.visual = VisionTransformer(spec.vision, self.tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """mm_embeds: (the step's token indices, their image embeddings), placed over the
        placeholder tokens' embeddings."""
        x = self.model.embed(input_ids)
        if mm_embeds is not None:
            x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
        return self.forward_embeds(x, positions, kv_caches, meta)

    def encode_image(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        return self.visual(pixels, grid)

    # ---- weights: transformers 5 nests the parts (model.language_model., model.visual.) ---------

    def checkpoint_targets(self, hf_name: str) -> list[tuple[str, int | None]]:
        name = _our_name(hf_name)
        if name.startswith("visual."):
            return vision_targets(self, name)
        return super().checkpoint_targets(name)


def vision_targets(model: LlamaForCausalLM, name: str) -> list[tuple[str, int | None]]:
    """A vision tower's tensor: one target, or each part of a fused q/k/v."""
    fused = model._fused_module(name.rsplit(".", 1)[0])
    return [(name, None)] if fused is None else [(name, shard) for shard in range(len(fused.parts))]


def _our_name(hf_name: str) -> str:
    if hf_name.startswith("model.language_model."):
        return "model." + hf_name.removeprefix("model.language_model.")
    if hf_name.startswith("model.visual."):
        return hf_name.removeprefix("model.")
    return hf_name
