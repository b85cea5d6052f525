"""EAGLE and EAGLE-3 proposers: a one-layer head (zllm/workers/models/llama_eagle.py) run in the
target's worker processes, sharded over the same ranks, with a KV cache of its own that shares
the target's block tables (token p's entry in the same slot in both caches).

The head's entry at position p is computed from the token at p + 1 and a feature of position p.
Each step the target's forward leaves its features (the final hidden state for EAGLE, the
residual stream entering three layers for EAGLE-3) for every position it computed; the runner
hands them over with each request's first position and row (`keep_features`). After the step,
the head catches up on every position the target verified, whose next token is known (the
prompt chunk, the accepted drafts and the position before the newly sampled token), in one
forward over the requests; the output at the last of them gives the first draft. Each further
draft is one decode forward at the next position, fed the previous draft and the head's own
feature (its output before the final norm). Those k - 1 forwards write entries past the
request's verified end, in slots the scheduler allocated ahead (`Scheduler.num_lookahead`); the
next catch-up rewrites them from the tokens that were kept.

Positions the target computed without the head seeing them (a prefix-cache hit: those blocks'
entries were written when another request computed them; a step without proposals) keep what
their slots hold: a head entry only steers the drafts, never what the rejection sampler keeps.
Proposals are the head's argmax, a deterministic proposer for which verification is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from zllm.eagle_spec import EagleSpec
from zllm.partition import head_shards
from zllm.workers.models.llama_eagle import EagleHead
from zllm.workers.spec_decode.draft_model import DraftRun, draft_batch
from zllm.workers.transfer import to_device
from zllm.workers.weight_loader import finish_loading, init_dummy_weights, load_safetensors

if TYPE_CHECKING:
    from zllm.workers.model_runner import ModelRunner, RequestState


class EagleProposer:
    needs_features = True  # the runner keeps the target's features of each step for it

    def __init__(self, runner: ModelRunner, head_dir: str, method: str, k: int) -> None:
        self.runner = runner
        self.k = k
        dummy = runner.config.load_format == "dummy"
        self.spec = EagleSpec.read(head_dir, method, runner.spec, with_weights=not dummy)
        layer = self.spec.layer
        tp = runner.tp
        heads = head_shards(layer.num_heads, layer.num_kv_heads, tp.size)[tp.rank]
        self.num_kv_heads = heads.kv_heads.count
        self.head_dim = layer.head_dim
        # (heads, kv heads, head_dim) on this rank: the runner reserves the decode workspace for it too
        self.attention_shape = (heads.q_heads.count, self.num_kv_heads, self.head_dim)
        self.max_model_len = runner.config.max_model_len
        previous = torch.get_default_dtype()
        torch.set_default_dtype(runner.dtype)
        try:
            with torch.device(runner.device):
                head = EagleHead(self.spec, runner.model, runner.ops, tp, self.max_model_len)
        finally:
            torch.set_default_dtype(previous)
        if dummy:
            init_dummy_weights(head, runner.config.seed + 1)
        else:
            load_safetensors(head, head_dir, torch_file=True)  # the heads are published as pytorch_model.bin
            head.load_d2t(head_dir)
        finish_loading(head)
        self.head = head.eval()
        if method == "eagle3":
            runner.model.aux_hidden_layers = self.spec.aux_layer_ids
        self.packs_prefill = runner.ops.packs_prefill(runner.dtype, layer.head_dim)
        self.kv_cache: torch.Tensor | None = None
        self._features: torch.Tensor | None = None  # the last step's target features, one row per token
        self._rows: dict[str, tuple[int, int]] = {}  # request id -> (its first position, its first row)

    # ---- memory --------------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        itemsize = self.runner.kv_cache_dtype.itemsize
        return 2 * self.num_kv_heads * self.head_dim * itemsize * self.runner.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.runner.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.runner.kv_cache_dtype, device=self.runner.device)

    def release_kv_cache(self) -> int:
        """Drop the cache (the memory profile's scratch one); returns the bytes it held."""
        size = 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()
        self.kv_cache = None
        return size

    # ---- requests ------------------------------------------------------------------------------

    def track(self, request_id: str, num_computed_tokens: int) -> None:
        pass  # nothing per request: each step's features say where its positions are

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def keep_features(self, hidden: torch.Tensor, rows: dict[str, tuple[int, int]]) -> None:
        """The target's step: its final hidden states (every token), and each request's first
        position and row in them. EAGLE-3 reads the aux layers the model kept instead."""
        self._features = self.runner.model.aux_hidden_states if self.spec.method == "eagle3" else hidden
        self._rows = rows

    # ---- proposing -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, scheduled: list[RequestState], sampled: list[RequestState]) -> dict[str, list[int]]:
        features, rows = self._features, self._rows
        self._features, self._rows = None, {}
        runs, feature_rows = [], []
        for state in scheduled:
            if state.request_id not in rows:
                continue
            start, first_row = rows[state.request_id]
            # Positions start..end-1 were verified this step; position p takes token p + 1.
            end = min(state.num_computed_tokens, len(state.token_ids) - 1, self.max_model_len)
            if end > start:
                runs.append(DraftRun(state.request_id, state.block_ids, start, state.token_ids[start + 1 : end + 1]))
                feature_rows.append(np.arange(first_row, first_row + end - start))
        if not runs:
            return {}
        order = sorted(range(len(runs)), key=lambda i: len(runs[i].token_ids) != 1)  # decodes first
        index = self._to_device(np.concatenate([feature_rows[i] for i in order]))
        target_features = self.head.combine_target_features(features[index])
        out, own = self._forward([runs[i] for i in order], target_features)
        ends = (np.asarray([len(runs[i].token_ids) for i in order]).cumsum() - 1)[np.argsort(order)]
        sampled_ids = {s.request_id for s in sampled}
        proposing = [i for i, run in enumerate(runs) if run.request_id in sampled_ids]
        if not proposing:
            return {}
        last = self._to_device(ends[proposing])
        tokens, own = self._greedy(out[last]), own[last]
        ids = [runs[i].request_id for i in proposing]
        blocks = {runs[i].request_id: runs[i].block_ids for i in proposing}
        nexts = {runs[i].request_id: runs[i].start + len(runs[i].token_ids) for i in proposing}
        drafts: dict[str, list[int]] = {rid: [] for rid in ids}
        block_size = self.runner.block_size
        for step in range(self.k):
            for request_id, token in zip(ids, tokens):
                drafts[request_id].append(token)
            if step == self.k - 1:
                break
            # The newest draft at the position after the last one, where a slot was allocated.
            keep = [
                j
                for j, rid in enumerate(ids)
                if nexts[rid] + step < min(self.max_model_len, len(blocks[rid]) * block_size)
            ]
            if not keep:
                break
            ids, tokens = [ids[j] for j in keep], [tokens[j] for j in keep]
            decode = [DraftRun(rid, blocks[rid], nexts[rid] + step, [t]) for rid, t in zip(ids, tokens)]
            out, own = self._forward(decode, own[self._to_device(keep)])
            tokens = self._greedy(out)
        return drafts

    def _forward(self, runs: list[DraftRun], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over runs (decodes first) with one feature per token: (logit inputs, own features)."""
        input_ids, positions, meta = draft_batch(self.runner, runs, self.packs_prefill)
        return self.head(input_ids, features, positions, self.kv_cache, meta)

    def _greedy(self, hidden: torch.Tensor) -> list[int]:
        """The head's most likely next token for each row, on every rank."""
        tokens = self.head.greedy(hidden)
        if tokens is None:
            tokens = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        return self.runner.tp.broadcast_from_first(tokens).tolist()

    def _to_device(self, values) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.int64), self.runner.device)
