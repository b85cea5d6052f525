"""Piecewise CUDA graphs: steps that carry prefill run the model's token-parallel parts as graphs.

A decode step replays one whole-forward graph (cuda_graphs.py), but a step with prefill chunks
cannot: how its tokens group into sequences (the attention metadata) changes every step. Every
other op of the forward treats each token alone, so the forward splits at attention into
num_layers + 1 pieces, as vLLM v1 does:

    piece 0:  embedding, layer 0 up to its rotated q (its k/v written to the cache)
    piece i:  layer i-1 from o_proj through its MLP, layer i up to its rotated q
    piece L:  layer L-1 from o_proj through its MLP, the final norm

Each piece is captured once per padded token count (`piecewise_sizes`) over static buffers;
between two pieces, attention runs eagerly on the step's real tokens with the step's metadata.
Padded rows carry cache slot -1 (nothing written) and whatever the buffers held; every captured
op is row-wise, so they never reach the real rows (a MoE layer routes them too, and its expert
GEMMs share tiles between tokens, but each output row is its own token's). What padding may
change is the kernel a GEMM takes for the larger row count, hence the rounding
(docs/architecture.md, "Which outputs are bit-stable"). A step of N tokens then launches L + 1
graphs and L attention calls instead of some dozens of kernels per layer.

The pieces hand each other their tensors through static buffers (q, residual, attention output):
a graph's own outputs would have to be kept per layer and per size. `EagerPieces` runs the same
pieces without graphs, so the splitting and the padding are tested on CPU.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from zllm.workers.attention import AttentionMetadata
from zllm.workers.graph_capture import GraphCapturer

logger = logging.getLogger(__name__)

_LARGEST_PIECEWISE_SIZE = 2048  # past this a step's GEMMs dwarf its launches: it runs eagerly


def piecewise_sizes(max_num_batched_tokens: int, largest: int = _LARGEST_PIECEWISE_SIZE) -> list[int]:
    """Padded token counts to capture, up to the step budget (or `largest`): 16-token steps to 64,
    32-token steps to 256, then 1/8 to 1/4 of the count, so a step pads by at most 31 tokens or a
    quarter of its size."""
    cap = min(max_num_batched_tokens, largest)
    sizes = [16, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    while sizes[-1] < cap:
        last = sizes[-1]
        sizes.append(last + max(32, 1 << (last.bit_length() - 3)))
    return [s for s in sizes if s < cap] + [cap]


class EagerPieces:
    """The forward as pieces over static buffers, run eagerly: what PiecewiseGraphs captures."""

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: list[int], hybrid: bool = False) -> None:
        self.model = model
        self.hybrid = hybrid  # two block tables (zllm/kv_layout.py)
        self.layers = model.model.layers
        self.kv_caches = kv_caches
        self.sizes = sizes
        largest = sizes[-1]
        first = self.layers[0].self_attn
        device, dtype = kv_caches[0].device, model.model.embed_tokens.weight.dtype
        hidden = model.spec.hidden_size
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        # A hybrid model's sliding layers write through their own tables' slots.
        self.sliding_slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.q = torch.zeros(largest, first.num_heads, first.head_dim, dtype=dtype, device=device)
        self.attended = torch.zeros(largest, first.num_heads, first.head_dim, dtype=dtype, device=device)
        self.residual = torch.zeros(largest, hidden, dtype=dtype, device=device)
        self.hidden = torch.zeros(largest, hidden, dtype=dtype, device=device)
        # EAGLE-3 (LlamaForCausalLM.aux_hidden_layers): the residual stream entering those layers,
        # side by side, written by the pieces that start them (so the graphs hold the copies too).
        self.aux_layers = tuple(getattr(model, "aux_hidden_layers", ()))
        self.aux = torch.zeros(largest, len(self.aux_layers) * hidden, dtype=dtype, device=device)

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def bucket(self, num_tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= num_tokens), None)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward of one step's tokens (at most sizes[-1]); returns [tokens, hidden]."""
        num_tokens = input_ids.shape[0]
        size = self.bucket(num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        self.slot_mapping[num_tokens:size].fill_(-1)
        if meta.sliding is not None:
            self.sliding_slot_mapping[:num_tokens].copy_(meta.sliding.slot_mapping)
            self.sliding_slot_mapping[num_tokens:size].fill_(-1)
        for index in range(self.num_pieces):
            if index > 0:  # the attention of layer index - 1, on the real tokens only
                layer = self.layers[index - 1]
                layer_meta = self.model.model.meta_of(index - 1, meta)
                attended = layer.self_attn.attend(self.q[:num_tokens], self.kv_caches[index - 1], layer_meta)
                self.attended[:num_tokens].copy_(attended.reshape(num_tokens, *self.attended.shape[1:]))
            self._run_piece(index, size)
        if self.aux_layers:
            self.model.aux_hidden_states = self.aux[:num_tokens]
        return self.hidden[:num_tokens]

    def _run_piece(self, index: int, size: int) -> None:
        self._piece(index, size)

    def _slots_of(self, layer: int) -> torch.Tensor:
        """The slot buffer layer `layer` writes through. Only a hybrid model's steps fill the
        sliding buffer (AttentionMetadata.sliding); for the others every layer uses slot_mapping."""
        return (
            self.sliding_slot_mapping if self.hybrid and layer in self.model.model.sliding_layers else self.slot_mapping
        )

    def _piece(self, index: int, size: int) -> None:
        """Piece `index` at `size` rows, from and to the static buffers."""
        if index == 0:
            x, residual = self.model.model.embed(self.input_ids[:size]), None
        else:
            x, residual = self.layers[index - 1].after_attention(self.attended[:size], self.residual[:size])
        if index == len(self.layers):
            x, _ = self.model.model.norm(x, residual)
            self.hidden[:size].copy_(x)
            return
        for j, layer in enumerate(self.aux_layers):  # a layer may be named twice: kept each time
            if layer == index:
                width = x.shape[-1]
                self.aux[:size, j * width : (j + 1) * width].copy_(x if residual is None else x + residual)
        q, residual = self.layers[index].before_attention(
            x,
            residual,
            self.positions[:size],
            self.model.model.rotary_of(index),
            self.kv_caches[index],
            self._slots_of(index)[:size],
        )
        self.q[:size].copy_(q)
        self.residual[:size].copy_(residual)


class PiecewiseGraphs(EagerPieces):
    """EagerPieces with every piece captured as a CUDA graph at every size."""

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: list[int], hybrid: bool = False) -> None:
        super().__init__(model, kv_caches, sizes, hybrid)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capturer = GraphCapturer()

    def capture(self) -> None:
        for size in reversed(self.sizes):  # largest first: the smaller sizes reuse its memory pool
            self.slot_mapping[:size].fill_(-1)  # capture writes no cache slot
            self.sliding_slot_mapping[:size].fill_(-1)
            for index in range(self.num_pieces):
                self.graphs[(index, size)], _ = self.capturer.capture(partial(self._piece, index, size))
        torch.cuda.synchronize()
        logger.info("captured piecewise CUDA graphs (%d pieces) for step sizes %s", self.num_pieces, self.sizes)

    def _run_piece(self, index: int, size: int) -> None:
        self.graphs[(index, size)].replay()
