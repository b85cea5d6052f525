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

import torch
import torch.nn.functional as F
from torch import nn

from zllm.model_spec import ModelSpec
from zllm.partition import Span, even_split
from zllm.workers.distributed import TensorParallel
from zllm.workers.layers import grouped_route
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
    out = torch.zeros_like(x)
    # [E, k, T]: which (slot, token) pairs chose each expert.
    chosen = F.one_hot(experts, num_classes=gate_up.shape[0]).permute(2, 1, 0)
    for expert in (chosen.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
        slot, token = torch.where(chosen[expert])
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class Experts(nn.Module):
    """Every expert's weights stacked, this rank's slice of the intermediate dimension:
    gate_up_proj [E, 2 * I_rank, H] (gate rows, then up rows) and down_proj [E, H, I_rank].

    Checkpoint shards: gate_up_proj has 2E (expert e's gate is 2e, its up 2e + 1), down_proj E."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, span: Span) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.span = span
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * span.count, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, span.count))

    def num_shards(self, param_name: str) -> int:
        return 2 * self.num_experts if param_name == "gate_up_proj" else self.num_experts

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        rows = slice(self.span.start, self.span.stop)
        if param_name == "gate_up_proj":
            expert, part = divmod(shard, 2)
            dest = self.gate_up_proj.data[expert].narrow(0, part * self.span.count, self.span.count)
            return LoadTarget(dest, (self.intermediate_size, self.hidden_size), (rows,))
        return LoadTarget(self.down_proj.data[shard], (self.hidden_size, self.intermediate_size), (slice(None), rows))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return expert_loop(x, weights, experts, self.gate_up_proj, self.down_proj)


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SwiGLU MLP whose output a sigmoid gate scales; this rank's
    slice, left unreduced (the block reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        rows = even_split(intermediate_size, tp.size, tp.rank)
        part = FusedPart(intermediate_size, rows)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [part, part], bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, rows, False, tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps, tp: TensorParallel) -> None:
        super().__init__()
        moe = spec.moe
        self.moe = moe
        self.ops = ops
        self.tp = tp
        self.fp32_weights = moe.format.fp32_routing_weights
        span = even_split(moe.intermediate_size, tp.size, tp.rank)
        deepseek = moe.routing != "softmax"
        self.gate = Router(spec.hidden_size, moe.num_experts, correction_bias=moe.routing == "noaux_tc", fp32=deepseek)
        self.experts = Experts(moe.num_experts, spec.hidden_size, moe.intermediate_size, span)
        self.shared_expert = self.shared_expert_gate = self.shared_experts = None
        if moe.shared_expert_intermediate_size and moe.shared_expert_gated:  # Qwen2-MoE
            self.shared_expert = SharedExpert(spec.hidden_size, moe.shared_expert_intermediate_size, tp)
            self.shared_expert_gate = Router(spec.hidden_size, 1)
        elif moe.shared_expert_intermediate_size:  # DeepSeek: n_shared_experts fused into one MLP, no gate
            self.shared_experts = SharedExpert(spec.hidden_size, moe.shared_expert_intermediate_size, tp)

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
