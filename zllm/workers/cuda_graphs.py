"""CUDA graphs for decode steps: one graph per padded batch size, captured at start-up.

A decode step (every request one token behind) has static shapes once the batch is padded to
a bucket, so the whole forward replays as one graph: inputs are copied into static buffers,
padded rows write their K/V nowhere (slot -1) and attend to one dummy token.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import torch

from zllm.workers.attention import AttentionMetadata
from zllm.workers.graph_capture import GraphCapturer

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded decode batch sizes to capture, up to max_num_seqs itself: fine steps where a padded
    row costs most (small batches), coarser ones past 256, where a step is compute-bound."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, max_num_seqs + 1, 32))
    sizes = [s for s in sizes if s <= max_num_seqs]
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        hybrid: bool = False,
    ):
        device = kv_caches[0].device
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = graph_batch_sizes(max_batch)
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        # A hybrid model's sliding layers (zllm/kv_layout.py): their own slots and block tables.
        self.hybrid = hybrid
        if hybrid:
            self.sliding_slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=device)
            self.sliding_block_tables = torch.zeros((largest, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capturer = GraphCapturer()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def capture(self) -> None:
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            forward = partial(self._forward, size, self._meta(size))
            self.graphs[size], self.outputs[size] = self.capturer.capture(forward)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def bucket(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens, sliding=None) -> torch.Tensor:
        """Replay the graph of the smallest bucket that holds the batch; returns [batch, hidden]."""
        size = self.load(input_ids, positions, slot_mapping, block_tables, seq_lens, sliding)
        self.graphs[size].replay()
        return self.outputs[size][: input_ids.shape[0]]

    def load(self, input_ids, positions, slot_mapping, block_tables, seq_lens, sliding=None) -> int:
        """Copy a step's inputs into the static buffers, the rows past the batch padded (slot -1,
        length 1); returns the bucket. `_forward(size, _meta(size))` is then what a replay
        computes (tests/test_mla_sinks_graphs.py runs it eagerly on CPU)."""
        batch = input_ids.shape[0]
        size = self.bucket(batch)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(slot_mapping)
        self.slot_mapping[batch:size].fill_(-1)
        width = block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(block_tables)
        self.seq_lens[:batch].copy_(seq_lens)
        self.seq_lens[batch:size].fill_(1)
        if self.hybrid:
            self.sliding_slot_mapping[:batch].copy_(sliding.slot_mapping)
            self.sliding_slot_mapping[batch:size].fill_(-1)
            self.sliding_block_tables[:batch, : sliding.block_tables.shape[1]].copy_(sliding.block_tables)
        return size

    def _meta(self, size: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            seq_lens_list=[],
            query_start_loc=list(range(size + 1)),
            num_decodes=size,
            block_size=self.block_size,
        )
        if self.hybrid:
            meta.sliding = dataclasses.replace(
                meta, slot_mapping=self.sliding_slot_mapping[:size], block_tables=self.sliding_block_tables[:size]
            )
        return meta

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
