"""A draft model: a smaller checkpoint with the target's vocabulary, run in the same worker
processes (sharded over the same ranks), with a KV cache of its own.

The draft's cache has the target's block count and shares its block tables: token p of a
request lives in the same slot in both caches. After each step the draft catches up on every
token the target has verified (the scheduled prompt chunks, the accepted drafts and the newly
sampled token, in one forward), then proposes k tokens greedily, one decode forward each.
Those k - 1 forwards write the draft's KV entries past the request's end (slots the scheduler
allocated ahead, `Scheduler.num_lookahead`); the next catch-up rewrites them with the tokens
that were really kept, so the draft's cache never holds a rejected token's entry at a verified
position.

Proposals are the draft's argmax: a deterministic proposer, for which the rejection sampler is
exact at any temperature (zllm/workers/spec_decode/rejection_sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from zllm.model_spec import ModelSpec
from zllm.partition import head_shards
from zllm.workers.attention import AttentionMetadata, pack_prefill, packed_prefill_of
from zllm.workers.models import build_model
from zllm.workers.transfer import to_device
from zllm.workers.weight_loader import finish_loading, init_dummy_weights, load_safetensors

if TYPE_CHECKING:
    from zllm.workers.model_runner import ModelRunner, RequestState


@dataclass(slots=True)
class DraftRun:
    """A request's tokens to feed the draft: `token_ids` at positions start, start + 1, ..."""

    request_id: str
    block_ids: list[int]
    start: int
    token_ids: list[int]


class DraftModelProposer:
    needs_features = False

    def __init__(self, runner: ModelRunner, model_dir: str, k: int) -> None:
        self.runner = runner
        self.k = k
        self.spec = ModelSpec.from_pretrained(model_dir)
        tp = runner.tp
        heads = head_shards(self.spec.num_heads, self.spec.num_kv_heads, tp.size)[tp.rank]
        self.num_kv_heads = heads.kv_heads.count
        # (heads, kv heads, head_dim) on this rank: the runner reserves the decode workspace for it too
        self.attention_shape = (heads.q_heads.count, self.num_kv_heads, self.spec.head_dim)
        self.max_model_len = runner.config.max_model_len
        previous = torch.get_default_dtype()
        torch.set_default_dtype(runner.dtype)
        try:
            with torch.device(runner.device):
                model = build_model(self.spec, runner.ops, tp, None)
        finally:
            torch.set_default_dtype(previous)
        if runner.config.load_format == "dummy":
            init_dummy_weights(model, runner.config.seed + 1)
        else:
            load_safetensors(model, model_dir)
        finish_loading(model)
        self.model = model.eval()
        self.packs_prefill = runner.ops.packs_prefill(runner.dtype, self.spec.head_dim)
        self.kv_caches: list[torch.Tensor] = []
        self.num_computed: dict[str, int] = {}  # request id -> tokens in the draft's cache

    # ---- memory --------------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        itemsize = self.runner.kv_cache_dtype.itemsize
        return 2 * self.spec.num_layers * self.num_kv_heads * self.spec.head_dim * itemsize * self.runner.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.runner.block_size, self.num_kv_heads, self.spec.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.runner.kv_cache_dtype, device=self.runner.device)
            for _ in range(self.spec.num_layers)
        ]

    def release_kv_cache(self) -> int:
        """Drop the cache (the memory profile's scratch one); returns the bytes it held."""
        size = sum(c.numel() * c.element_size() for c in self.kv_caches)
        self.kv_caches = []
        return size

    # ---- requests ------------------------------------------------------------------------------

    def track(self, request_id: str, num_computed_tokens: int) -> None:
        """A request the workers take (new, or resumed): the target's cache holds its first
        `num_computed_tokens` tokens (a prefix-cache hit), and so does the draft's, whose blocks
        were filled by the same steps."""
        self.num_computed[request_id] = num_computed_tokens

    def forget(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)

    # ---- proposing -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, scheduled: list[RequestState], sampled: list[RequestState]) -> dict[str, list[int]]:
        sampled_ids = {s.request_id for s in sampled}
        runs = [self._catch_up_run(state, state.request_id in sampled_ids) for state in scheduled]
        runs = [r for r in runs if r.token_ids]
        for run in runs:
            self.num_computed[run.request_id] = run.start + len(run.token_ids)
        proposing = [r for r in runs if r.request_id in sampled_ids]
        if not runs:
            return {}
        last = self._forward(runs)
        if not proposing:
            return {}
        ends = {r.request_id: r.start + len(r.token_ids) for r in proposing}  # where the first draft goes
        blocks = {r.request_id: r.block_ids for r in proposing}
        drafts: dict[str, list[int]] = {r.request_id: [] for r in proposing}
        index = {r.request_id: i for i, r in enumerate(runs)}
        ids = [r.request_id for r in proposing]
        tokens = self._greedy(last[[index[rid] for rid in ids]])
        for step in range(self.k):
            for request_id, token in zip(ids, tokens):
                drafts[request_id].append(token)
            if step == self.k - 1:
                break
            # Feed each request its newest draft, at the position after its last one.
            feed = [(rid, t) for rid, t in zip(ids, tokens) if ends[rid] + step < self.max_model_len]
            if not feed:
                break
            ids = [rid for rid, _ in feed]
            tokens = self._greedy(self._forward([DraftRun(rid, blocks[rid], ends[rid] + step, [t]) for rid, t in feed]))
        return drafts

    def _catch_up_run(self, state: RequestState, sampled: bool) -> DraftRun:
        """The target-verified tokens the draft has not seen: up to the target's computed count,
        and the token just sampled (its logits propose the first draft)."""
        start = self.num_computed.get(state.request_id, 0)
        end = len(state.token_ids) if sampled else state.num_computed_tokens
        end = min(end, self.max_model_len)
        return DraftRun(state.request_id, state.block_ids, start, state.token_ids[start:end])

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        """The draft's most likely next token for each row, on every rank."""
        logits = self.model.compute_logits(hidden)
        if logits is not None:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        return self.runner.tp.broadcast_from_first(tokens).tolist()

    def _forward(self, runs: list[DraftRun]) -> torch.Tensor:
        """One draft forward over the runs; the hidden state of each run's last token, in order."""
        order = sorted(range(len(runs)), key=lambda i: len(runs[i].token_ids) != 1)  # decodes first
        ordered = [runs[i] for i in order]
        input_ids, positions, meta = self._batch(ordered)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        ends = np.asarray(meta.query_start_loc[1:]) - 1
        last_of_ordered = ends[np.argsort(order)]  # back to the caller's order
        return hidden[to_device(last_of_ordered.astype(np.int64), self.runner.device)]

    def _batch(self, runs: list[DraftRun]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return draft_batch(self.runner, runs, self.packs_prefill)


def draft_batch(
    runner: ModelRunner, runs: list[DraftRun], packs_prefill: bool
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A proposer's forward inputs over runs (decodes first) in the target's block tables: token
    ids, positions and attention metadata (the draft model's and EAGLE heads' own caches)."""
    block_size = runner.block_size
    counts = np.asarray([len(r.token_ids) for r in runs], dtype=np.int64)
    starts = np.asarray([r.start for r in runs], dtype=np.int64)
    query_start_loc = np.concatenate(([0], np.cumsum(counts))).tolist()
    seq_lens = (starts + counts).tolist()
    num_decodes = int((counts == 1).sum())
    width = max(len(r.block_ids) for r in runs)
    tables = np.zeros((len(runs), width), dtype=np.int64)
    for row, run in enumerate(runs):
        tables[row, : len(run.block_ids)] = run.block_ids
    positions = np.arange(query_start_loc[-1]) + np.repeat(starts - np.asarray(query_start_loc[:-1]), counts)
    rows = np.repeat(np.arange(len(runs)), counts)
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    token_ids = np.asarray([t for r in runs for t in r.token_ids], dtype=np.int64)
    device = runner.device
    meta = AttentionMetadata(
        slot_mapping=to_device(slots, device),
        block_tables=to_device(tables, device).to(runner.index_dtype),
        seq_lens=to_device(np.asarray(seq_lens, dtype=np.int64), device).to(runner.index_dtype),
        seq_lens_list=seq_lens,
        query_start_loc=query_start_loc,
        num_decodes=num_decodes,
        block_size=block_size,
    )
    if packs_prefill and num_decodes < len(runs):
        context_slots, cu_seqs = pack_prefill(tables, seq_lens, query_start_loc, num_decodes, block_size)
        meta.prefill = packed_prefill_of(
            to_device(np.asarray(context_slots, dtype=np.int64), device),
            to_device(np.asarray(cu_seqs, dtype=np.int64), device),
            seq_lens,
            query_start_loc,
            num_decodes,
        )
    return to_device(token_ids, device), to_device(positions.astype(np.int64), device), meta
