"""The pooling runner: one forward per step over whole inputs, one vector per input, no KV cache.

A step's inputs are sorted by length and packed ([N] token rows, no padding) for the embeddings,
the linear layers and the MLPs; attention runs on groups of inputs of similar length, each padded
to its longest (zllm/workers/models/bert.py), so padding costs little even when a step mixes
16- and 128-token inputs. The pooled vectors (mean / CLS / last token, or the classifier head's
logits) go back to the core as float32 bytes, and the runner forgets the inputs at once.
On CUDA the packed steps replay CUDA graphs, padded to a bucket (zllm/workers/pooling_graphs.py).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from zllm import envs
from zllm.config import EngineConfig
from zllm.ipc.messages import ArrayData, NewRequestData, PooledSlice, PoolingSlice, StepInput, StepOutput
from zllm.model_spec import ModelSpec
from zllm.workers.distributed import TensorParallel
from zllm.workers.model_runner import _default_dtype, resolve_dtype
from zllm.workers.models.bert import BertModel, PackedInputs, PaddedGroup
from zllm.workers.models.decoder_pooling import DecoderForPooling
from zllm.workers.models.modernbert import ModernBertModel
from zllm.workers.ops import ops_for
from zllm.workers.pooling_graphs import EagerPoolingSteps, PoolingGraphs
from zllm.workers.transfer import to_device
from zllm.workers.weight_loader import finish_loading, init_dummy_weights, load_safetensors

logger = logging.getLogger(__name__)

# A group's padded size may exceed its real tokens by this factor before a new group starts.
_MAX_PADDING = 1.25


@dataclass(slots=True)
class PooledStep:
    step_id: int
    request_ids: list[str] = field(default_factory=list)
    slices: list[PoolingSlice] = field(default_factory=list)
    # [inputs, width] float32: request_ids' rows, then the slices' rows, in the step's order
    pooled: torch.Tensor | None = None


class _StepInputs(NamedTuple):
    """A step's inputs as arrays, sorted by length: token ids, lengths, token types, and where
    each input of the step's order went (sorted row of input i)."""

    token_ids: np.ndarray
    lengths: np.ndarray
    token_types: np.ndarray
    rank: np.ndarray


class PoolingRunner:
    """The ModelRunner's interface (load, steps, release) for a pooling model."""

    def __init__(self, config: EngineConfig, device: torch.device, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.device = device
        self.tp = tp or TensorParallel()
        self.spec = ModelSpec.from_pretrained(config.model)
        self.dtype = resolve_dtype(config.dtype, device, self.spec.checkpoint_dtype)
        self.pooling_type = config.pooler.pooling_type
        # CUDA in half precision: FlashAttention over the packed inputs; else torch's SDPA over
        # groups of similar length (the reference, and fp32).
        self.packs = packs_inputs(device, self.dtype, self.spec.head_dim)
        self.model: BertModel | ModernBertModel | DecoderForPooling | None = None
        # Packed steps at padded sizes: CUDA graphs on a GPU, the same steps eagerly elsewhere.
        self.graphs: EagerPoolingSteps | None = None

    def load_model(self) -> None:
        with _default_dtype(self.dtype), torch.device(self.device):
            if self.spec.encoder:
                encoder = ModernBertModel if self.spec.pooling.family == "modernbert" else BertModel
                model = encoder(self.spec, self.tp)
            else:
                model = DecoderForPooling(self.spec, ops_for(self.device), self.tp, self.config.pooler)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            load_safetensors(model, self.config.model)
        finish_loading(model)
        self.model = model.eval()

    def determine_num_kv_blocks(self) -> int:
        return 1  # no KV cache: the core's pool is a formality

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def capture_graphs(self) -> None:
        """CUDA graphs for the packed steps (FlashAttention's varlen kernel reads the step's
        structure from the device); the grouped SDPA path (fp32, CPU) sizes its groups on the host
        and stays eager, as does everything under --enforce-eager. Off a GPU, packed steps (tests
        only) run the padded steps eagerly."""
        if not self.packs or self.config.enforce_eager:
            if self.device.type == "cuda" and not self.config.enforce_eager:
                logger.info("pooling CUDA graphs off: %s steps attend per group (SDPA), sized on the host", self.dtype)
            return
        args = (
            self.model,
            self.pooling_type,
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            self.config.max_model_len,
        )
        ops = ops_for(self.device)
        if not (self.device.type == "cuda" and ops.supports_graphs):
            self.graphs = EagerPoolingSteps(*args)
            return
        if not envs.ZLLM_POOLING_CUDA_GRAPHS:
            # Measured slower than the eager packed steps on an H100 (docs/benchmarks.md): the
            # padding to a bucket costs more than the launches the graphs save at these step sizes.
            logger.info("pooling CUDA graphs off (ZLLM_POOLING_CUDA_GRAPHS=1 turns them on)")
            return
        if self.spec.moe is not None and not ops.fuses_moe(self.dtype):
            # The torch expert loop picks the experts on the host (a sync): no graph can hold it.
            logger.info("pooling CUDA graphs off: %s's experts run in the torch loop", self.spec.architecture)
            return
        self.graphs = PoolingGraphs(*args)
        with torch.inference_mode():
            self.graphs.capture()

    def release_device_memory(self) -> None:
        self.graphs = None
        self.model = None

    # ---- steps ---------------------------------------------------------------------------------

    def launch_step(self, step: StepInput) -> PooledStep:
        launched = PooledStep(step.step_id, [r.request_id for r in step.new_requests], step.pooling_slices)
        if step.new_requests or step.pooling_slices:
            with torch.inference_mode():
                launched.pooled = self._pool(self._step_inputs(step))
        return launched

    def sample_step(self, launched: PooledStep, grammar=None) -> None:
        pass  # nothing to sample

    def finish_step(self, launched: PooledStep) -> StepOutput:
        output = StepOutput(step_id=launched.step_id, request_ids=launched.request_ids, sampled_token_ids=[])
        if launched.pooled is None:
            return output
        rows = launched.pooled.cpu().numpy().astype("<f4", copy=False)
        output.pooled = {rid: rows[i].tobytes() for i, rid in enumerate(launched.request_ids)}
        first = len(launched.request_ids)
        for part in launched.slices:
            count = part.lengths.shape[0]
            vectors = ArrayData.of(rows[first : first + count])
            output.pooled_slices.append(PooledSlice(part.batch_id, part.first, vectors))
            first += count
        return output

    def _step_inputs(self, step: StepInput) -> _StepInputs:
        """The single requests' ids and the slices' arrays as one sorted set of arrays: inputs of
        similar length attend together (the grouped path pads each group to its longest)."""
        requests = step.new_requests
        lengths = np.fromiter((len(r.token_ids) for r in requests), np.int64, count=len(requests))
        parts = [
            np.fromiter(itertools.chain.from_iterable(r.token_ids for r in requests), np.int64, count=lengths.sum())
        ]
        types = [self._token_types(requests, int(lengths.sum()))]
        for part in step.pooling_slices:
            parts.append(part.token_ids.to_numpy().astype(np.int64))
            lengths = np.concatenate((lengths, part.lengths.to_numpy()))
            types.append(np.zeros(len(parts[-1]), dtype=np.int64))
        token_ids, token_types = np.concatenate(parts), np.concatenate(types)
        order = np.argsort(lengths, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        if (order[1:] < order[:-1]).any():
            # Each input's rows moved as a whole: sorted row r reads from its input's old start.
            starts = np.cumsum(lengths) - lengths
            sorted_lengths = lengths[order]
            sorted_starts = np.cumsum(sorted_lengths) - sorted_lengths
            gather = np.arange(len(token_ids)) + np.repeat(starts[order] - sorted_starts, sorted_lengths)
            token_ids, token_types, lengths = token_ids[gather], token_types[gather], sorted_lengths
        return _StepInputs(token_ids, lengths, token_types, rank)

    def _token_types(self, requests: list[NewRequestData], total: int) -> np.ndarray:
        if not any(r.pooling is not None and r.pooling.token_type_ids is not None for r in requests):
            return np.zeros(total, dtype=np.int64)
        return np.concatenate([_token_types(r, self.spec.type_vocab_size) for r in requests])

    def _pool(self, inputs: _StepInputs) -> torch.Tensor:
        """The step's vectors, in the step's order (single requests, then the slices' inputs)."""
        lengths = inputs.lengths.tolist()
        total = len(inputs.token_ids)
        positions = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(inputs.lengths) - inputs.lengths, lengths)
        if self.graphs is not None:
            pooled = self.graphs.run(inputs.token_ids, positions, inputs.token_types, inputs.lengths)
            if pooled is not None:  # a copy in the step's order: the next replay rewrites the graph's rows
                return pooled.index_select(0, to_device(inputs.rank, self.device))
        groups = self._packed(lengths) if self.packs else self._groups(lengths)
        hidden = self.model(
            to_device(inputs.token_ids, self.device),
            to_device(positions, self.device),
            to_device(inputs.token_types, self.device),
            groups,
        )
        pooled = self._pooled(hidden, lengths).float()
        if (inputs.rank == np.arange(len(lengths))).all():
            return pooled
        return pooled.index_select(0, to_device(inputs.rank, self.device))

    def _packed(self, lengths: list[int]) -> PackedInputs:
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        return PackedInputs(to_device(offsets, self.device), max(lengths))

    def _groups(self, lengths: list[int]) -> list[PaddedGroup]:
        return [self._group(lengths, first, stop) for first, stop in _similar_lengths(lengths)]

    def _group(self, lengths: list[int], first: int, stop: int) -> PaddedGroup:
        """Inputs first..stop-1 as one padded attention batch over their packed rows."""
        mine = lengths[first:stop]
        longest = max(mine)
        offsets = np.cumsum([0, *mine[:-1]])
        columns = np.arange(longest)
        valid = columns[None, :] < np.asarray(mine)[:, None]
        index = np.where(valid, offsets[:, None] + columns[None, :], 0)
        start = sum(lengths[:first])
        rows = np.flatnonzero(valid)
        return PaddedGroup(start, start + sum(mine), *(to_device(a, self.device) for a in (index, valid, rows)))

    def _pooled(self, hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """One row per input. NOTE: nothing here waits for the device (no pageable copy, no
        data-dependent shape), so under async scheduling the next step launches behind it."""
        head = self.model.head
        if head is None:
            return self._pooled_rows(hidden, lengths, self.pooling_type)
        # The head reads the first token (BERT), the last (decoders) or the mean (ModernBERT's
        # classifier_pooling "mean"), in the model's dtype.
        return head(self._pooled_rows(hidden, lengths, self.model.head_pooling).to(hidden.dtype))

    def _pooled_rows(self, hidden: torch.Tensor, lengths: list[int], pooling_type: str) -> torch.Tensor:
        counts = to_device(np.asarray(lengths, dtype=np.int64), self.device)
        starts = torch.cumsum(counts, 0) - counts
        if pooling_type == "cls":
            return hidden[starts]
        if pooling_type == "last":
            return hidden[starts + counts - 1]
        # Mean pooling sums in fp32: a bf16 sum of a hundred rows would lose the low bits.
        segment = torch.repeat_interleave(
            torch.arange(len(lengths), device=hidden.device), counts, output_size=hidden.shape[0]
        )
        sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, segment, hidden.float()) / counts[:, None].float()


def packs_inputs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a step's inputs go packed to FlashAttention (the ops' own test for packed prefills)."""
    return ops_for(device).packs_prefill(dtype, head_dim)


def _token_types(request: NewRequestData, type_vocab_size: int) -> np.ndarray:
    """The input's segment ids (a text pair's), zeros where the model has no second segment."""
    given = request.pooling.token_type_ids if request.pooling is not None else None
    if given is None or type_vocab_size < 2:
        return np.zeros(len(request.token_ids), dtype=np.int64)
    return np.asarray(given, dtype=np.int64)


def _similar_lengths(lengths: list[int]) -> list[tuple[int, int]]:
    """Runs of the ascending `lengths` whose padding to their longest stays under _MAX_PADDING."""
    runs, first, total = [], 0, 0
    for index, length in enumerate(lengths):
        if index > first and (index - first + 1) * length > _MAX_PADDING * (total + length):
            runs.append((first, index))
            first, total = index, 0
        total += length
    runs.append((first, len(lengths)))
    return runs
