"""LoRA on a worker: adapters in host memory (LRU, `max_cpu_loras`), `max_loras` device slots
(LRU), and the batched shrink/expand that adds each row's adapter to a projection's output.

Every adapted projection holds one stack of slots, sharded like the projection itself:

    column-parallel (q/k/v, gate/up: output rows split):  A [slots, parts * R, in]   whole
                                                          B [out_rank, slots, R]      this rank's rows
    row-parallel (o, down: input columns split):          A [slots, R, in_rank]       this rank's columns
                                                          B [out, slots, R]           whole

B keeps the slots in the middle so that a part's rows over every slot are one [rows, slots * R]
matrix (the dense path's expand GEMM). R is max_lora_rank (a smaller adapter is zero-padded). A
fused projection keeps each part's A in its own R rows and its B in the part's output rows. A slot's
A holds the adapter's A times its scale (lora_alpha / r, per part), folded in once at load (in
float32, before the cast to the model dtype; exact for the usual power-of-two scales), so no path
multiplies by a scale per step: that saves the dense path a launch per projection. A row-parallel
rank adds B (A_rank x_rank) to its partial product before the all-reduce: the sum over ranks is
B A x, with no extra collective.

Three paths:
- torch (CPU, and the reference): a step's rows are grouped by slot (`LoRABatch.groups`); per
  group t = x_rows A_slot^T (shrink), then out_rows += t_part B_part^T for each part (expand).
  The groups' row indices come from the host each step.
- CUDA (csrc/lora_kernels.cu): every row reads its slot from `LoRABatch.token_slots`, a device
  buffer of fixed address filled before each step (-1: the base model; padding rows too), so the
  decode and piecewise CUDA graphs hold the launches and stay on with LoRA. Steps of few tokens.
  Where the projection's own product takes the GEMV kernels (1 row; 2-8 rows; dense weights) the
  expand runs in the GEMV's epilogue (`LoRALayer.project`, ops.linear_lora: csrc/gemv_kernels.cu
  gemv_lora_*): a projection is then the shrink and one GEMV, two launches instead of three
  (ZLLM_LORA_FUSED_EXPAND=0: the separate expand). At batch-1 decode those launches, not bytes,
  are LoRA's cost (Llama-3-8B: 128 projections a token).
  With ZLLM_LORA_NORM_SHRINK (on by default) the add-RMSNorm before q/k/v and gate/up computes
  their shrink in its own launch at decode (`LoRALayer.add_rms_norm`, csrc/layernorm_kernels.cu
  fused_add_rms_norm_lora_shrink) and the projection uses it (`shrunk`): one launch less each;
  the same switch has the MLP's gated activation compute down_proj's shrink in its launch
  (`LoRALayer.act_and_mul`, csrc/activation_kernels.cu *_and_mul_lora_shrink).
- dense (CUDA, steps of many tokens: `LoRABatch.dense_from` rows and more, decided by the launch's
  padded row count so a CUDA graph holds one path): the shrink is one GEMM over every slot at
  once, x [T, in] @ A.view(S * P * R, in)^T; each row keeps only its own slot's columns
  (times `LoRABatch.slot_mask`, a one-hot [rows, S] of the row's slot filled on the device before
  each step; written in [T, P, S, R] order); then per part one GEMM
  out_p += t_p [T, S * R] @ B_p [rows, S * R]^T. It reads A and B once a step instead of once a
  token (the kernels re-read B[slot]'s rows, 917 KB
  for Llama-3-8B's rank-16 gate_up, for every token), at S times the FLOPs on the tensor cores.
  All torch ops: tested on the CPU against `apply_slot`.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from zllm import envs
from zllm.config import EngineConfig
from zllm.lora import TARGET_MODULES, WEIGHTS_FILE, LoRARequest, check_adapter
from zllm.model_spec import ModelSpec
from zllm.workers import ops
from zllm.workers.distributed import TensorParallel
from zllm.workers.kernels.matvec import LoRAEpilogue
from zllm.workers.linear_weights import DenseWeights
from zllm.workers.parallel_layers import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoRABatch:
    """The current step's rows by adapter slot: (slot, row indices; None: every row) for the
    torch path; each row's slot in a device buffer for the kernels (None: the torch path), and
    the same as a one-hot [rows, slots] (1.0 in the row's slot's column; a zero row for -1) for
    the dense path, which launches of `dense_from` rows or more take."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    token_slots: torch.Tensor | None = None
    slot_mask: torch.Tensor | None = None
    dense_from: int = 0
    fused_expand: bool = False  # launches the GEMV kernels take add the expand in their epilogue
    # Decode launches: the add-RMSNorm before q/k/v, gate/up and the activation before down run
    # the shrink of the projection after them (ZLLM_LORA_NORM_SHRINK).
    norm_shrink: bool = False

    def fill_slot_mask(self) -> None:
        """The one-hot of token_slots (on the device, once a step: every layer reads it)."""
        assert self.token_slots is not None and self.slot_mask is not None
        slots = torch.arange(self.slot_mask.shape[1], dtype=self.token_slots.dtype, device=self.token_slots.device)
        torch.eq(self.token_slots.unsqueeze(1), slots, out=self.slot_mask)


class LoRALayer:
    """One projection's adapter slots on this rank (see the module docstring for the layout)."""

    def __init__(
        self,
        linear: ColumnParallelLinear | RowParallelLinear,
        num_slots: int,
        max_rank: int,
        batch: LoRABatch,
    ) -> None:
        self.column = isinstance(linear, ColumnParallelLinear)
        parts = linear.parts if self.column else None
        self.part_rows: list[tuple[int, int]] = []  # (first output row on this rank, rows), per part
        offset = 0
        for count in [p.span.count for p in parts] if parts else [linear.weight.shape[0]]:
            self.part_rows.append((offset, count))
            offset += count
        self.linear = linear
        self.rank = max_rank
        in_features = linear.weight.shape[1]
        weight = linear.weight
        self.A = torch.zeros(
            num_slots, len(self.part_rows) * max_rank, in_features, dtype=weight.dtype, device=weight.device
        )
        self.B = torch.zeros(offset, num_slots, max_rank, dtype=weight.dtype, device=weight.device)
        self.part_ends = [start + count for start, count in self.part_rows]
        self.batch = batch
        # (the norm's or activation's output, its shrink): add_rms_norm's or act_and_mul's, for the
        # next project() of that tensor.
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The projection's product (its weights times x, plus bias) with each row's adapter added:
        in one GEMV launch after the shrink where that applies (`fuses`), else added to the
        weights' product."""
        if self.fuses(x):
            slots = self.batch.token_slots[: x.shape[0]]
            lora = LoRAEpilogue(self.shrunk(x), self.B, slots, self.part_ends)
            return ops.linear_lora(x, self.linear.weight, bias, lora)
        return self.add_to(self.linear.weights.apply(self.linear, x, bias), x)

    def norm_shrinks(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the add-RMSNorm of x and residual (this projection's input) runs its shrink
        too (add_rms_norm): ZLLM_LORA_NORM_SHRINK (set on CUDA's kernel path only), a launch of
        the kernel path (not the dense one) of decode rows, operands the kernel takes."""
        batch = self.batch
        return (
            batch.norm_shrink
            and batch.token_slots is not None
            and x.shape[0] < batch.dense_from
            and ops.norm_shrinks(x, residual, weight, self.A)
        )

    def add_rms_norm(
        self,
        norm_ops: ops.TorchOps,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The add-RMSNorm before this projection, its shrink in the same launch, held for the
        project() of the normed tensor: (normed, residual) as ops.add_rms_norm returns them."""
        slots = self.batch.token_slots[: x.shape[0]]
        normed, residual, t = norm_ops.add_rms_norm_lora_shrink(x, residual, weight, eps, unit_offset, self.A, slots)
        self.held = (normed, t)
        return normed, residual

    def act_shrinks(self, x: torch.Tensor) -> bool:
        """Whether the gated activation of x (gate then up; its output is this projection's input)
        runs this projection's shrink too (act_and_mul): norm_shrinks' switch and conditions."""
        batch = self.batch
        return (
            batch.norm_shrink
            and batch.token_slots is not None
            and x.shape[0] < batch.dense_from
            and ops.act_shrinks(x, self.A)
        )

    def act_and_mul(self, act_ops: ops.TorchOps, x: torch.Tensor, gelu: bool) -> torch.Tensor:
        """The gated activation before this projection (gelu_tanh, else silu), its shrink in the
        same launch, held for the project() of the activation's output, which it returns."""
        slots = self.batch.token_slots[: x.shape[0]]
        out, t = act_ops.act_and_mul_lora_shrink(x, gelu, self.A, slots)
        self.held = (out, t)
        return out

    def shrunk(self, x: torch.Tensor) -> torch.Tensor:
        """t = x A[slot]^T per row (float32): the one the norm or activation computed for this very tensor, else
        a lora_shrink launch. A held shrink is used once."""
        held, self.held = self.held, None
        if held is not None and held[0] is x:
            return held[1]
        return ops.lora_shrink(x, self.A, self.batch.token_slots[: x.shape[0]])

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether project() fuses the expand into the GEMV: the kernel path (not the dense one)
        with ZLLM_LORA_FUSED_EXPAND on, dense weights, and a launch ops.linear_lora takes."""
        batch = self.batch
        return (
            batch.fused_expand
            and batch.token_slots is not None
            and x.shape[0] < batch.dense_from
            and isinstance(self.linear.weights, DenseWeights)
            and ops.fuses_lora(x, self.linear.weight, self.B)
        )

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + each row's adapter applied to x (rows of the base model unchanged)."""
        if self.batch.token_slots is not None:
            if self.batch.slot_mask is not None and x.shape[0] >= self.batch.dense_from:
                return self.add_dense(out, x)
            return self._add_with_kernels(out, x)
        for slot, rows in self.batch.groups:
            delta = self.apply_slot(slot, x if rows is None else x.index_select(0, rows))
            if rows is None:
                out = out + delta
            else:
                out = out.index_add(0, rows, delta)
        return out

    def _add_with_kernels(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from zllm.workers.kernels.lora import lora_expand

        slots = self.batch.token_slots[: x.shape[0]]
        return lora_expand(out, self.shrunk(x), self.B, slots, self.part_ends)

    def add_dense(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """In place: out + each row's adapter, for every slot at once (the module docstring's
        dense path); rows whose slot_mask row is zero (the base model, padding) are unchanged."""
        return dense_add(out, x, self.A, self.B, self.batch.slot_mask, self.part_rows)

    def apply_slot(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        """The torch reference of the shrink and expand for rows of one adapter (PEFT's order of
        operations but for the scale, folded into A)."""
        shrunk = F.linear(x, self.A[slot])
        R = self.rank
        return torch.cat(
            [
                F.linear(shrunk[:, p * R : (p + 1) * R], self.B[start : start + count, slot])
                for p, (start, count) in enumerate(self.part_rows)
            ],
            dim=-1,
        )

    def clear(self, slot: int) -> None:
        self.A[slot].zero_()
        self.B[:, slot].zero_()

    def store(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """A part's matrices (already this rank's shard, A times the part's scale) into a slot."""
        r = a.shape[0]
        start, count = self.part_rows[part]
        self.A[slot, part * self.rank : part * self.rank + r].copy_(a)
        self.B[start : start + count, slot, :r].copy_(b)

    def shard(self, part: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a full (A [r, in], B [out, r]): B's rows of a column-parallel part,
        A's columns of a row-parallel projection."""
        if self.column:
            span = self.linear.parts[part].span
            return a, b[span.start : span.stop]
        span = self.linear.span
        return a[:, span.start : span.stop], b


def dense_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slot_mask: torch.Tensor,
    part_rows: list[tuple[int, int]],
) -> torch.Tensor:
    """In place: out[:, rows of part p] += (x a[slot]^T)_p b[rows of p, slot]^T for each row's
    slot, as GEMMs over every slot. a [S, P * R, in], b [out, S, R], slot_mask [>= T, S] in x's
    dtype (one-hot of the row's slot; a zero row adds nothing)."""
    rows = x.shape[0]
    slots, parts = a.shape[0], len(part_rows)
    rank = a.shape[1] // parts
    shrunk = F.linear(x, a.view(slots * parts * rank, -1)).view(rows, slots, parts, rank)
    # Only the row's own slot's columns, in [T, P, S, R] order: part p's are one [T, S * R] matrix.
    t = torch.empty((rows, parts, slots, rank), dtype=x.dtype, device=x.device)
    torch.mul(shrunk.transpose(1, 2), slot_mask[:rows, None, :, None], out=t)
    for p, (start, count) in enumerate(part_rows):
        b_part = b[start : start + count].view(count, slots * rank)
        out[:, start : start + count].addmm_(t[:, p].reshape(rows, slots * rank), b_part.t())
    return out


def dense_from(num_slots: int) -> int:
    """The launch size (rows) from which LoRA on CUDA runs the dense path: ZLLM_LORA_DENSE_ROWS_PER_SLOT
    rows per device slot.

    Per row, the kernels read the slot's A and B rows, c = R (P in + out) 2 bytes, mostly from L2
    (~4-5 TB/s on an H100); the dense path reads every slot's once a step from HBM (S c bytes at
    ~3.3 TB/s) and spends 2 S c FLOPs a row (~0.5 PFLOP/s): the two cost the same at
    T = S (L2 / HBM) / (1 - 2 S L2 / FLOPs), about 1.5-2 S for S = 8-16, and the kernels' decode
    launches are latency-bound below that, the dense path's 2 + P launches costing more at small
    T: hence 4 rows a slot (32 rows for 8 slots, 64 for 16)."""
    per_slot = envs.ZLLM_LORA_DENSE_ROWS_PER_SLOT
    if not math.isfinite(per_slot):  # inf: never
        return sys.maxsize
    return max(0, math.ceil(per_slot * num_slots))


# (layer, zllm module) -> per part: (A times the part's scale, B) this rank's shards on the host, or None
HostAdapter = dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]]


class LoRAManager:
    """The adapters of one worker: loaded into host memory when a request first names one, moved
    into a device slot when a step needs it. The engine core never schedules more than
    max_loras distinct adapters in one step, so a step's adapters always fit in the slots."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, spec: ModelSpec, tp: TensorParallel) -> None:
        self.spec = spec
        self.max_rank = config.max_lora_rank
        self.num_slots = config.max_loras
        self.max_host = config.max_cpu_loras or config.max_loras
        self.tp = tp
        self.batch = LoRABatch()
        self.layers: dict[tuple[int, str], LoRALayer] = {}
        for index, layer in enumerate(model.model.layers):
            for name, linear in (
                ("qkv_proj", layer.self_attn.qkv_proj),
                ("o_proj", layer.self_attn.o_proj),
                ("gate_up_proj", layer.mlp.gate_up_proj),
                ("down_proj", layer.mlp.down_proj),
            ):
                linear.lora = self.layers[(index, name)] = LoRALayer(linear, self.num_slots, self.max_rank, self.batch)
        self.device = model.model.layers[0].self_attn.qkv_proj.weight.device
        if self._kernels_apply(config):
            # Every step's tokens (and a CUDA graph's padding) fit: the budget, or a decode batch
            # with its drafts.
            drafts = config.speculative_config.num_speculative_tokens if config.speculative_config else 0
            size = max(config.max_num_batched_tokens, config.max_num_seqs * (1 + drafts))
            self.batch.token_slots = torch.full((size,), -1, dtype=torch.int32, device=self.device)
            dtype = self.layers[(0, "qkv_proj")].A.dtype
            self.batch.slot_mask = torch.zeros((size, self.num_slots), dtype=dtype, device=self.device)
            self.batch.dense_from = dense_from(self.num_slots)
            self.batch.fused_expand = envs.ZLLM_LORA_FUSED_EXPAND
            self.batch.norm_shrink = envs.ZLLM_LORA_NORM_SHRINK
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()  # LRU order: least recent first
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU order
        self.users: Counter[int] = Counter()  # live requests per adapter: pinned in host memory

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, lora: LoRARequest) -> None:
        """Hold the request's adapter in host memory (loading it now if needed); ValueError if it
        cannot be loaded (the request fails alone)."""
        if lora.lora_int_id not in self.host:
            adapter = self._load(lora)
            self._make_host_room()
            self.host[lora.lora_int_id] = adapter
        self.host.move_to_end(lora.lora_int_id)
        self.users[lora.lora_int_id] += 1

    def release(self, lora_id: int) -> None:
        self.users[lora_id] -= 1
        if self.users[lora_id] <= 0:
            del self.users[lora_id]

    def _make_host_room(self) -> None:
        """Drop least recently used adapters no live request uses until one more fits."""
        for lora_id in list(self.host):
            if len(self.host) < self.max_host:
                return
            if not self.users[lora_id]:
                del self.host[lora_id]
                self.users.pop(lora_id, None)
        if len(self.host) >= self.max_host:
            logger.warning("lora: %d adapters in use exceed max_cpu_loras (%d)", len(self.host) + 1, self.max_host)

    def _load(self, lora: LoRARequest) -> HostAdapter:
        info = check_adapter(lora.lora_path, self.spec, self.max_rank)
        try:
            tensors = load_file(f"{lora.lora_path}/{WEIGHTS_FILE}", device="cpu")
        except Exception as error:  # noqa: BLE001 - any unreadable file is the adapter's fault
            raise ValueError(f"lora adapter {lora.lora_path}: cannot read {WEIGHTS_FILE}: {error}") from None
        adapter: HostAdapter = {}
        by_projection = {(t.layer, t.module, t.matrix): tensors[t.name] for t in info.tensors}
        for (layer, module), scale in info.scaling.items():
            name, part = TARGET_MODULES[module]
            lora_layer = self.layers[(layer, name)]
            a, b = lora_layer.shard(part or 0, by_projection[(layer, module, "A")], by_projection[(layer, module, "B")])
            dtype = lora_layer.A.dtype
            parts = adapter.setdefault((layer, name), [None] * len(lora_layer.part_rows))
            scaled = (a.to(torch.float32) * scale).to(dtype)  # the scale folded in before rounding
            parts[part or 0] = (scaled.contiguous(), b.to(dtype).contiguous())
        logger.info("lora: loaded adapter %r (id %d, rank %d)", lora.lora_name, lora.lora_int_id, info.rank)
        return adapter

    # ---- steps ---------------------------------------------------------------------------------

    @property
    def graph_safe(self) -> bool:
        """Whether CUDA graphs may hold the adapted projections (the kernel path)."""
        return self.batch.token_slots is not None

    def _kernels_apply(self, config: EngineConfig) -> bool:
        """The CUDA kernels serve every adapted projection (dtype, widths, rank), unless the
        ZLLM_LORA_KERNELS switch is off."""
        if self.device.type != "cuda" or not envs.ZLLM_LORA_KERNELS:
            return False
        from zllm.workers.kernels.lora import supports

        return all(supports(layer.A.dtype, layer.A.shape[2], layer.rank) for layer in self.layers.values())

    def prepare(self, token_lora_ids: np.ndarray) -> None:
        """Put the step's adapters in device slots, and give each row its slot: in the device
        buffer (kernels) or as groups of rows (torch)."""
        ids = [int(i) for i in np.unique(token_lora_ids) if i]
        for lora_id in ids:
            self._to_slot(lora_id, keep=ids)
        for lora_id in ids:
            self.slots.move_to_end(lora_id)
        if self.batch.token_slots is not None:
            self._fill_token_slots(token_lora_ids)
            return
        groups = []
        for lora_id in ids:
            mask = token_lora_ids == lora_id
            rows = None if mask.all() else torch.from_numpy(np.flatnonzero(mask)).to(self.device)
            groups.append((self.slots[lora_id], rows))
        self.batch.groups = groups

    def _fill_token_slots(self, token_lora_ids: np.ndarray) -> None:
        """Each token's slot (-1: the base model, and every row past the step's tokens, which a
        CUDA graph pads with), copied into the fixed buffer on the step's stream."""
        from zllm.workers.transfer import to_device

        buffer = self.batch.token_slots
        host = np.full(buffer.shape[0], -1, dtype=np.int32)
        for lora_id, slot in self.slots.items():
            host[: len(token_lora_ids)][token_lora_ids == lora_id] = slot
        buffer.copy_(to_device(host, self.device), non_blocking=True)
        self.batch.fill_slot_mask()

    def _to_slot(self, lora_id: int, keep: list[int]) -> None:
        if lora_id in self.slots:
            return
        if len(self.slots) < self.num_slots:
            taken = set(self.slots.values())
            slot = next(s for s in range(self.num_slots) if s not in taken)
        else:
            victim = next(i for i in self.slots if i not in keep)  # the least recently used one
            slot = self.slots.pop(victim)
        self._copy_to_slot(self.host[lora_id], slot)
        self.slots[lora_id] = slot

    def _copy_to_slot(self, adapter: HostAdapter, slot: int) -> None:
        for key, layer in self.layers.items():
            layer.clear(slot)
            for part, entry in enumerate(adapter.get(key, ())):
                if entry is not None:
                    layer.store(slot, part, *entry)
