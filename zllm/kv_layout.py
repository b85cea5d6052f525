"""How the KV cache is split between a model's full-attention and sliding-window layers.

The engine core (which hands out blocks) and the workers (which hold the tensors) both read the
split from here, so that a block id means the same memory on both sides.

    no window (Llama, Qwen):          one group, every layer; blocks kept for the whole sequence
    a window in every layer (Mistral, Phi-3):
                                      one group with the window: blocks behind it are freed
    windows in some layers (Gemma 2/3):
                                      group 0 = the full layers, group 1 = the sliding layers,
                                      each with its own blocks and block tables

The profiled budget is counted in blocks of every layer (`num_blocks` x all layers' bytes per
block). A hybrid model divides those layer-blocks between its groups so that the most sequences
of max_model_len fit: each holds every block in a full layer, and in a sliding layer only the
blocks its window reaches (window / block_size + 1). A prefill chunk reaches past the window by
up to the step's token budget; one step's chunks add at most max_num_batched_tokens over all
sequences, so the sliding layers keep that much in reserve once, not per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zllm.config import EngineConfig
    from zllm.model_spec import ModelSpec


def cache_entry(spec: ModelSpec, num_kv_heads: int) -> tuple[int, int, int]:
    """(parts, heads, values) of one token in one layer's cache on a rank, by the layer's kind of
    attention: per-head keys and values (2, this rank's KV heads, head_dim); MLA's latent and
    rotated shared key (1, 1, kv_lora_rank + qk_rope_head_dim), the same on every rank (replicated:
    zllm/workers/models/deepseek.py says why). A layer's cache is [parts, blocks, block_size,
    heads, values]."""
    if spec.mla is not None:
        return (1, 1, spec.mla.latent_dim)
    return (2, num_kv_heads, spec.head_dim)


def cache_bytes_per_token(spec: ModelSpec, num_kv_heads: int, itemsize: int) -> int:
    """Bytes of one token in every layer's cache on a rank: what sizes the blocks a memory budget
    holds, so MLA's smaller entry gives more blocks."""
    parts, heads, values = cache_entry(spec, num_kv_heads)
    return spec.num_layers * parts * heads * values * itemsize


def blocks_held(num_tokens: int, window: int | None, block_size: int, max_chunk: int) -> int:
    """The most blocks one sequence of num_tokens holds at once in a group with this window, when
    a step computes at most max_chunk of its tokens: every block without a window; with one, the
    blocks from the window's start before a chunk to the chunk's end (plus one for the block the
    window starts in part-way)."""
    every = -(-num_tokens // block_size)
    if window is None:
        return every
    return min(every, -(-(window - 1 + max_chunk) // block_size) + 1)


@dataclass(frozen=True, slots=True)
class KVGroup:
    layers: tuple[int, ...]
    window: int | None  # tokens a query looks back in these layers; None: the whole context
    num_blocks: int  # blocks of each of these layers' caches (a window group's block 0 is the null block)


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    window: int | None
    sliding_layers: tuple[int, ...]
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int

    @classmethod
    def of(cls, spec: ModelSpec, config: EngineConfig) -> KVLayout:
        """The engine's layout; with config.disable_hybrid_kv_cache_manager, one group that keeps
        every block (the layers still attend within their windows)."""
        windowed = bool(spec.sliding_layers) and not config.disable_hybrid_kv_cache_manager
        return cls(
            spec.num_layers,
            spec.sliding_window if windowed else None,
            tuple(spec.sliding_layers) if windowed else (),
            config.block_size,
            config.max_model_len,
            config.max_num_batched_tokens,
        )

    @property
    def is_hybrid(self) -> bool:
        return self.window is not None and len(self.sliding_layers) < self.num_layers

    @property
    def full_layers(self) -> tuple[int, ...]:
        sliding = set(self.sliding_layers)
        return tuple(i for i in range(self.num_layers) if i not in sliding)

    def blocks_held(self, num_tokens: int, window: int | None) -> int:
        return blocks_held(num_tokens, window, self.block_size, self.max_num_batched_tokens)

    def steady_blocks(self, num_tokens: int, window: int | None) -> int:
        """The blocks a sequence of num_tokens holds between its prefill chunks (while decoding)."""
        every = -(-num_tokens // self.block_size)
        return every if window is None else min(every, -(-window // self.block_size) + 1)

    def chunk_reserve(self, window: int | None) -> int:
        """The blocks one step's prefill chunks add beyond every sequence's steady holding."""
        return 0 if window is None else -(-self.max_num_batched_tokens // self.block_size)

    def max_concurrency(self, groups: list[KVGroup]) -> float:
        """How many sequences of max_model_len the groups hold at once (steady state)."""
        return min(
            max(g.num_blocks - (g.window is not None) - self.chunk_reserve(g.window), 0)
            / self.steady_blocks(self.max_model_len, g.window)
            for g in groups
        )

    def groups(self, num_blocks: int) -> list[KVGroup]:
        """The groups for a budget of num_blocks blocks of every layer."""
        if self.window is None:
            return [KVGroup(tuple(range(self.num_layers)), None, num_blocks)]
        if not self.is_hybrid:
            return [KVGroup(tuple(range(self.num_layers)), self.window, num_blocks)]
        full, sliding = self.full_layers, self.sliding_layers
        per_full = self.steady_blocks(self.max_model_len, None)
        per_sliding = self.steady_blocks(self.max_model_len, self.window)
        reserve = self.chunk_reserve(self.window) + 1  # + the null block
        # n sequences: len(full) * n * per_full + len(sliding) * (n * per_sliding + reserve) layer-blocks.
        layer_blocks = num_blocks * self.num_layers
        n = max(layer_blocks - len(sliding) * reserve, 0) / (len(full) * per_full + len(sliding) * per_sliding)
        full_blocks = max(int(n * per_full), 1)
        sliding_blocks = (layer_blocks - len(full) * full_blocks) // len(sliding)
        return [KVGroup(full, None, full_blocks), KVGroup(sliding, self.window, max(sliding_blocks, 2))]
