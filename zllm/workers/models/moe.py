"""The Mixture-of-Experts block of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 (zllm/model_spec.py's MoeSpec),
which replaces the dense MLP in the layers the spec names; attention, norms and the rest are
models/llama.py's.

Tensor parallelism as vLLM does it by default: every rank holds every expert, sliced along the
expert's intermediate dimension (gate/up rows, down columns), plus a replicated router; the
experts' and the shared expert's partial products are summed in one all-reduce per block.

How the block runs is the ops' choice (zllm/workers/ops.py `moe`): TorchOps routes with
layers.moe_route and runs Experts.forward, expert by expert in ascending order, each adding its
weighted output with index_add_ as transformers does (the CPU path and the oracle); CudaOps runs
the fused kernels of csrc/moe_kernels.cu on fp16/bf16 (no host sync: the decode graphs and the
piecewise graphs' pieces hold them; SparseMoeBlock.graph_safe).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zllm.model_spec import ModelSpec
from zllm.partition import Span, even_split
from zllm.quantization import BLOCK, QuantSpec
from zllm.workers.distributed import TensorParallel
from zllm.workers.fp8 import E4M3, dequantize_stacked, quantize_blocks
from zllm.workers.layers import grouped_route
from zllm.workers.linear_weights import check_block_aligned
from zllm.workers.ops import TorchOps, linear
from zllm.workers.parallel_layers import ColumnParallelLinear, FusedPart, LoadTarget, RowParallelLinear


class Router(nn.Module):
    """The replicated gate: hidden -> one logit per expert (no bias in any supported model).
    fp32: DeepSeek's gate, which HF keeps in fp32 whatever the model dtype; correction_bias:
    DeepSeek-V3's e_score_correction_bias, one fp32 value per expert."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = False, fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32 if fp32 else None))
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)

    def fp32_logits(self, x: torch.Tensor) -> torch.Tensor:
        """DeepSeek's router logits, in fp32 whatever the model dtype (HF keeps the gate in fp32)."""
        return F.linear(x.float(), self.weight.float())


def expert_loop(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """sum over each token's top-k experts e of weight * down_e(silu(gate_e x) * up_e x), expert by
    expert in ascending order as transformers' eager path: x [T, H], weights [T, k], experts [T, k]
    (int64), gate_up [E, 2I, H], down [E, H, I], in whatever dtype they have (the oracle of the
    fused kernels and of their float64 checks)."""
    return expert_loop_of(x, weights, experts, gate_up.shape[0], lambda e: (gate_up[e], down[e]))


def expert_loop_of(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """expert_loop with each chosen expert's (gate_up [2I, H], down [H, I]) asked for when its
    turn comes (FP8 experts dequantize one expert at a time)."""
    out = torch.zeros_like(x)
    # [E, k, T]: which (slot, token) pairs chose each expert.
    chosen = F.one_hot(experts, num_classes=num_experts).permute(2, 1, 0)
    for expert in (chosen.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
        slot, token = torch.where(chosen[expert])
        gate_up, down = expert_weights(expert)
        gate, up = F.linear(x[token], gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class Experts(nn.Module):
    """Every expert's weights stacked, this rank's slice of the intermediate dimension:
    gate_up_proj [E, 2 * I_rank, H] (gate rows, then up rows) and down_proj [E, H, I_rank].

    Checkpoint shards: gate_up_proj has 2E (expert e's gate is 2e, its up 2e + 1), down_proj E."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, span: Span, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.span = span
        grad = dtype is None  # float8 parameters cannot require gradients
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * span.count, hidden_size, dtype=dtype), grad)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, span.count, dtype=dtype), grad)

    def num_shards(self, param_name: str) -> int:
        return 2 * self.num_experts if param_name.startswith("gate_up_proj") else self.num_experts

    def stacked(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked weights the fused kernels multiply by for routing `ids` [T, k], and the ids
        into them: the parameters themselves here (Fp8Experts: dequantized copies)."""
        return self.gate_up_proj, self.down_proj, ids

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the experts multiply in (the model's)."""
        return self.gate_up_proj.dtype

    def fused_shape(self) -> tuple[int, int, int]:
        """(experts, hidden, this rank's intermediate) as the fused kernels see the weights."""
        return self.num_experts, self.hidden_size, self.span.count

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        rows = slice(self.span.start, self.span.stop)
        if param_name == "gate_up_proj":
            expert, part = divmod(shard, 2)
            dest = self.gate_up_proj.data[expert].narrow(0, part * self.span.count, self.span.count)
            return LoadTarget(dest, (self.intermediate_size, self.hidden_size), (rows,))
        return LoadTarget(self.down_proj.data[shard], (self.hidden_size, self.intermediate_size), (slice(None), rows))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return expert_loop(x, weights, experts, self.gate_up_proj, self.down_proj)


class Fp8Experts(Experts):
    """Experts held as a block-FP8 checkpoint stores them (ZLLM_FP8_BLOCKS keep: DeepSeek-V3's
    release would not fit in bf16): E4M3 gate_up_proj / down_proj as Experts' and fp32 scales per
    128x128 tile of each checkpoint matrix, gate_up_proj_scale_inv [E, 2 * ceil(I_rank / 128),
    ceil(H / 128)] (gate's tiles, then up's) and down_proj_scale_inv [E, ceil(H / 128),
    ceil(I_rank / 128)]. They multiply in the model dtype: the loop dequantizes each chosen expert
    in its turn, the fused kernels get dequantized copies of the chosen experts (`stacked`), the
    values the dequantize-at-load path holds (fp8.dequantize, then the model dtype)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, span: Span, serialized: bool):
        check_block_aligned("MoE experts' intermediate shard", span.start, span.count, intermediate_size)
        super().__init__(num_experts, hidden_size, intermediate_size, span, dtype=E4M3)
        self._compute_dtype = torch.get_default_dtype()  # the model's: it is built under it
        self.serialized = serialized  # False: dummy weights, quantized while loading
        self.row_blocks, self.col_blocks = -(-span.count // BLOCK), -(-hidden_size // BLOCK)
        self.gate_up_proj_scale_inv = nn.Parameter(
            torch.empty(num_experts, 2 * self.row_blocks, self.col_blocks, dtype=torch.float32), False
        )
        self.down_proj_scale_inv = nn.Parameter(
            torch.empty(num_experts, self.col_blocks, self.row_blocks, dtype=torch.float32), False
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self._compute_dtype

    def checkpoint_params(self) -> tuple[str, ...]:
        weights = ("gate_up_proj", "down_proj")
        return (*weights, "gate_up_proj_scale_inv", "down_proj_scale_inv") if self.serialized else weights

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        blocks = _blocks_of(self.span)
        full_blocks = (-(-self.intermediate_size // BLOCK), self.col_blocks)
        if param_name == "gate_up_proj_scale_inv":
            expert, part = divmod(shard, 2)
            dest = self.gate_up_proj_scale_inv.data[expert].narrow(0, part * self.row_blocks, self.row_blocks)
            return LoadTarget(dest, full_blocks, (blocks,))
        if param_name == "down_proj_scale_inv":
            return LoadTarget(self.down_proj_scale_inv.data[shard], full_blocks[::-1], (slice(None), blocks))
        target = super().load_target(param_name, shard)
        if param_name == "gate_up_proj":
            expert, part = divmod(shard, 2)
            scale = self.gate_up_proj_scale_inv.data[expert].narrow(0, part * self.row_blocks, self.row_blocks)
        else:
            scale = self.down_proj_scale_inv.data[shard]
        store = _checked_fp8(target.dest) if self.serialized else _block_quantizer(target.dest, scale)
        return LoadTarget(target.dest, target.full_shape, target.region, store)

    def dequantized(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's (gate_up [2I, H], down [H, I]) in `dtype`."""
        gate_up, down = self._dequantize(
            self.gate_up_proj[expert : expert + 1],
            self.down_proj[expert : expert + 1],
            self.gate_up_proj_scale_inv[expert : expert + 1],
            self.down_proj_scale_inv[expert : expert + 1],
            dtype,
        )
        return gate_up[0], down[0]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return expert_loop_of(x, weights, experts, self.num_experts, lambda e: self.dequantized(e, x.dtype))

    def stacked(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fewer (token, slot) pairs than experts (decode): each pair's expert dequantized into a
        stack of its own, and ids renumbered to it (no host sync: shapes follow the batch);
        otherwise every expert. Either way at most one layer's experts are dequantized at a time."""
        if ids.numel() >= self.num_experts:
            return (
                *self._dequantize(
                    self.gate_up_proj, self.down_proj, self.gate_up_proj_scale_inv, self.down_proj_scale_inv, dtype
                ),
                ids,
            )
        chosen = ids.flatten().long()
        gate_up, down = self._dequantize(
            _gather(self.gate_up_proj, chosen),
            _gather(self.down_proj, chosen),
            self.gate_up_proj_scale_inv[chosen],
            self.down_proj_scale_inv[chosen],
            dtype,
        )
        return gate_up, down, torch.arange(ids.numel(), device=ids.device, dtype=ids.dtype).view_as(ids)

    def _dequantize(
        self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor, down_scale: torch.Tensor, dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count, blocks = self.span.count, self.row_blocks
        out = torch.empty(gate_up.shape, dtype=dtype, device=gate_up.device)
        dequantize_stacked(gate_up[:, :count], gate_up_scale[:, :blocks], out[:, :count])
        dequantize_stacked(gate_up[:, count:], gate_up_scale[:, blocks:], out[:, count:])
        return out, dequantize_stacked(down, down_scale, torch.empty(down.shape, dtype=dtype, device=down.device))


def _gather(weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """weights[chosen] of E4M3 weights, gathered as bytes (indexing kernels take every integer
    type; not every torch build takes float8)."""
    return weights.view(torch.uint8)[chosen].view(E4M3)


def _blocks_of(span: Span) -> slice:
    return slice(span.start // BLOCK, -(-span.stop // BLOCK))


def _checked_fp8(dest: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def store(values: torch.Tensor) -> None:
        if values.dtype != E4M3:
            raise ValueError(
                f"expected float8_e4m3fn expert weights (the config's quantization_config), got {values.dtype}"
            )
        dest.copy_(values)

    return store


def _block_quantizer(dest: torch.Tensor, scale: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """Dummy weights: a matrix's values quantized per 128x128 tile into dest and its scales."""

    def store(values: torch.Tensor) -> None:
        q, s = quantize_blocks(values.to(dest.device))
        dest.copy_(q)
        scale.copy_(s)

    return store


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SwiGLU MLP whose output a sigmoid gate scales; this rank's
    slice, left unreduced (the block reduces once). quant: DeepSeek's shared experts in a kept
    block-FP8 checkpoint."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, tp: TensorParallel, quant: QuantSpec | None = None
    ) -> None:
        super().__init__()
        rows = even_split(intermediate_size, tp.size, tp.rank)
        part = FusedPart(intermediate_size, rows)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [part, part], bias=False, quant=quant)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, rows, False, tp, reduce=False, quant=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps, tp: TensorParallel, quant: QuantSpec | None = None) -> None:
        """quant: a block-FP8 checkpoint kept as stored (ZLLM_FP8_BLOCKS): FP8 experts and shared
        experts; None otherwise (FP8 weights of other MoE checkpoints are refused earlier)."""
        super().__init__()
        moe = spec.moe
        self.moe = moe
        self.ops = ops
        self.tp = tp
        self.fp32_weights = moe.format.fp32_routing_weights
        span = even_split(moe.intermediate_size, tp.size, tp.rank)
        deepseek = moe.routing != "softmax"
        self.gate = Router(spec.hidden_size, moe.num_experts, correction_bias=moe.routing == "noaux_tc", fp32=deepseek)
        if quant is None:
            self.experts = Experts(moe.num_experts, spec.hidden_size, moe.intermediate_size, span)
        else:
            self.experts = Fp8Experts(moe.num_experts, spec.hidden_size, moe.intermediate_size, span, quant.serialized)
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if moe.shared_expert_intermediate_size and moe.shared_expert_gated:  # Qwen2-MoE
            self.shared_expert = SharedExpert(spec.hidden_size, moe.shared_expert_intermediate_size, tp)
            self.shared_expert_gate = Router(spec.hidden_size, 1)
        elif moe.shared_expert_intermediate_size:  # DeepSeek: n_shared_experts fused into one MLP, no gate
            self.shared_experts = SharedExpert(spec.hidden_size, moe.shared_expert_intermediate_size, tp, quant)

    @property
    def graph_safe(self) -> bool:
        """No host sync in this block, so CUDA graphs (decode and piecewise) can hold it: routing
        and the shared experts are plain device ops, the experts must run fused."""
        return self.ops.fuses_experts(self.experts, self.moe.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        if moe.routing == "softmax":
            out = self.ops.moe(x, self.gate(x), self.experts, moe.top_k, moe.renormalize, self.fp32_weights)
        else:
            weights, ids = grouped_route(
                self.gate.fp32_logits(x),
                moe.top_k,
                moe.routing,
                moe.n_group,
                moe.topk_group,
                moe.renormalize,
                moe.routed_scaling_factor,
                getattr(self.gate, "e_score_correction_bias", None),
            )
            out = self.ops.moe_experts(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        elif self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out
