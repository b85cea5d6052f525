"""GPT-OSS's Mixture-of-Experts block (HF GptOssMLP), in the Llama-family decoder of
models/llama.py, whose attention carries GPT-OSS's sinks, windows and biases.

- Router: a linear layer with a bias; the top k logits, softmaxed among themselves.
- Experts: gate_up and down with biases; the clamped SwiGLU on interleaved gate/up columns:
  gate = min(gate, limit), up = clamp(up, ±limit), (up + 1) * gate * sigmoid(alpha * gate).
- Checkpoints store every expert fused: `experts.gate_up_proj` [E, H, 2I] (gate and up columns
  interleaved) and `experts.down_proj` [E, I, H] in transformers' own saves; OpenAI's releases
  store them in MXFP4 (`quantization_config.quant_method: mxfp4`): `<proj>_blocks` [E, out,
  in / 32, 16] uint8, two E2M1 values a byte (the low nibble first), and `<proj>_scales`
  [E, out, in / 32] uint8, one E8M0 exponent (biased by 127) per 32 values, as transformers'
  mxfp4 integration reads them.

Both are read as stored into parameters of the checkpoint's own shapes (every rank reads the
whole tensors), then `finish_loading` dequantizes MXFP4 (`dequantize_mxfp4`, transformers'
arithmetic: value * 2^(scale - 127)) and keeps this rank's slice of the intermediate dimension in
the compute dtype, gate rows then up rows, and frees the stored form. Tensor parallelism as the
other MoE blocks: every expert's slice on every rank, one all-reduce; the down bias is added on
rank 0 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.model_spec import ModelSpec
from zllm.partition import even_split
from zllm.workers.distributed import TensorParallel
from zllm.workers.ops import TorchOps
from zllm.workers.parallel_layers import LoadTarget, whole_tensor_target

# The 16 E2M1 values by their 4-bit code (sign bit 3), as transformers' FP4_VALUES.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # values per E8M0 scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks [..., groups, 16] uint8 and scales [..., groups] uint8 -> [..., groups * 32]
    in `dtype`: each byte's low nibble is the even value, its high nibble the odd one; every 32
    values times 2^(scale - 127)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    out = torch.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int64)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int64)]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None].to(dtype))
    return out.reshape(*out.shape[:-2], -1)


class GptOssRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))


class GptOssExperts(nn.Module):
    """The stored tensors (parameters named as the checkpoint's, replicated), then, after
    loading, this rank's compute weights: w_gate_up [E, 2 I_rank, H] (gate rows, then up rows),
    b_gate_up [E, 2 I_rank], w_down [E, H, I_rank], b_down [E, H] (zero on ranks > 0)."""

    STORED = ("gate_up_proj", "down_proj")

    def __init__(self, spec: ModelSpec, tp: TensorParallel) -> None:
        super().__init__()
        moe = spec.moe
        e, h, i = moe.num_experts, spec.hidden_size, moe.intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.span = even_split(i, tp.size, tp.rank)
        self.first_rank = tp.rank == 0
        self.mxfp4 = moe.mxfp4
        if self.mxfp4:
            for name, (out, inp) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
                if inp % MXFP4_GROUP:
                    raise ValueError(f"model: MXFP4 {name} needs an input size divisible by 32, got {inp}")
                groups = inp // MXFP4_GROUP
                blocks = torch.empty(e, out, groups, MXFP4_GROUP // 2, dtype=torch.uint8)
                self.register_parameter(f"{name}_blocks", nn.Parameter(blocks, requires_grad=False))
                scales = torch.empty(e, out, groups, dtype=torch.uint8)
                self.register_parameter(f"{name}_scales", nn.Parameter(scales, requires_grad=False))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
            self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def load_target(self, param_name: str, shard: int | None) -> LoadTarget:
        return whole_tensor_target(getattr(self, param_name))

    def finish_loading(self) -> None:
        """The stored form into this rank's compute weights; the stored parameters are dropped."""
        dtype = self.gate_up_proj_bias.dtype
        if self.mxfp4:
            gate_up = dequantize_mxfp4(self.gate_up_proj_blocks, self.gate_up_proj_scales, dtype)  # [E, 2I, H]
            down = dequantize_mxfp4(self.down_proj_blocks, self.down_proj_scales, dtype)  # [E, H, I]
        else:
            gate_up = self.gate_up_proj.data.transpose(1, 2)
            down = self.down_proj.data.transpose(1, 2)
        cols = slice(self.span.start, self.span.stop)
        bias = self.gate_up_proj_bias.data
        down_bias = self.down_proj_bias.data
        computed = {
            "w_gate_up": torch.cat((gate_up[:, 0::2][:, cols], gate_up[:, 1::2][:, cols]), dim=1),
            "b_gate_up": torch.cat((bias[:, 0::2][:, cols], bias[:, 1::2][:, cols]), dim=1),
            "w_down": down[:, :, cols],
            "b_down": down_bias if self.first_rank else torch.zeros_like(down_bias),
        }
        for name in [n for n, _ in self.named_parameters(recurse=False)]:
            delattr(self, name)
        for name, value in computed.items():
            self.register_buffer(name, value.contiguous().clone(), persistent=False)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of [..., 2 I] (gate half, then up half)."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """HF GptOssExperts' loop: expert by expert in ascending order, each adding its weighted
        output with index_add_. Picks the experts on the host (a sync): the reference and the
        CPU path; forward_grouped and forward_dense are the graph-safe ones."""
        out = torch.zeros_like(x)
        chosen = F.one_hot(experts, num_classes=self.num_experts).permute(2, 1, 0)  # [E, k, T]
        for expert in (chosen.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
            slot, token = torch.where(chosen[expert])
            hidden = self._activate(F.linear(x[token], self.w_gate_up[expert], self.b_gate_up[expert]))
            y = F.linear(hidden, self.w_down[expert], self.b_down[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The loop's result with no host sync and shapes set by the token count alone: the
        (token, slot) pairs sorted by expert on the device, one torch._grouped_mm per projection
        over the stacked weights (each expert's rows a group; an unchosen expert's group is
        empty), each row's expert bias gathered. Reads only the chosen experts' weights."""
        tokens, top_k = experts.shape
        flat = experts.flatten()
        order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, ascending
        chosen = flat[order].long()
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.int32))  # bincount would sync
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        token = order // top_k
        rows = x.index_select(0, token)
        gate_up = torch._grouped_mm(rows, self.w_gate_up.transpose(1, 2), offs=ends) + self.b_gate_up[chosen]
        y = torch._grouped_mm(self._activate(gate_up), self.w_down.transpose(1, 2), offs=ends)
        y = (y + self.b_down[chosen]) * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The loop's result with no host sync, for any dtype: every expert on every token, each
        output weighted by its routing weight (0 where not chosen). E / k times the loop's
        arithmetic and every expert's weights read: the graph-safe path for small models (tests,
        fp32) and GPUs without torch._grouped_mm."""
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        combine.scatter_(1, experts.long(), weights)  # [T, E]
        gate_up = torch.einsum("th,eoh->eto", x, self.w_gate_up) + self.b_gate_up[:, None, :]
        y = torch.einsum("eti,ehi->eth", self._activate(gate_up), self.w_down) + self.b_down[:, None, :]
        return (y * combine.t()[:, :, None]).sum(dim=0).to(x.dtype)


class GptOssMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, ops: TorchOps, tp: TensorParallel) -> None:
        super().__init__()
        self.top_k = spec.moe.top_k
        self.ops = ops
        self.tp = tp
        self.router = GptOssRouter(spec.hidden_size, spec.moe.num_experts)
        self.experts = GptOssExperts(spec, tp)

    @property
    def graph_safe(self) -> bool:
        """No host sync on CUDA: ops.gpt_oss_experts runs grouped GEMMs (Hopper bf16) or every
        expert on every token, shapes set by the token count alone."""
        return self.ops.supports_graphs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        out = self.ops.gpt_oss_experts(x, weights, ids, self.experts)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out
