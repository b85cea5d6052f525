"""LLaVA: a CLIP or SigLIP vision transformer, a projector (linear, activation, linear), and a
Llama-family decoder whose image placeholder tokens take the projected patch features.

```
 CLIP:   pixel_values [3, H, W] --patch conv--> [class token, patches] + learned positions --pre-norm-->
 SigLIP: pixel_values [3, H, W] --patch conv (a bias)--> [patches] + learned positions
 encoder layers up to vision_feature_layer (-2: all but the last) --drop the first position
 ("default")--> projector --> [patches, hidden]: one token per position kept
```

The towers' post-layernorm (and SigLIP's pooling head) are in checkpoints but not on LLaVA's path:
transformers takes hidden_states[vision_feature_layer], the states before them.

Positions are the plain 1-D ones. The tower's attention and MLP are tensor-parallel as Qwen2-VL's
are (zllm/workers/models/qwen2_vl.py); embeddings, norms and the projector are replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zllm.model_spec import VisionSpec
from zllm.workers.attention import AttentionMetadata
from zllm.workers.distributed import TensorParallel
from zllm.workers.models.llama import LlamaForCausalLM
from zllm.workers.models.qwen2_vl import _activation, column, row, tower_parallel, vision_targets


class CLIPAttention(nn.Module):
    def __init__(self, v: VisionSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = v.num_heads // tp.size  # this rank's
        self.q_proj = column(v.hidden_size, v.hidden_size, tp)
        self.k_proj = column(v.hidden_size, v.hidden_size, tp)
        self.v_proj = column(v.hidden_size, v.hidden_size, tp)
        self.out_proj = row(v.hidden_size, v.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = (
            p(x).view(tokens, self.num_heads, -1).transpose(0, 1)[None] for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1).reshape(tokens, -1)
        return self.out_proj(out)


class CLIPMLP(nn.Module):
    def __init__(self, v: VisionSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.act = _activation(v.hidden_act)
        self.fc1 = column(v.hidden_size, v.intermediate_size, tp)
        self.fc2 = row(v.intermediate_size, v.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPLayer(nn.Module):
    def __init__(self, v: VisionSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = CLIPAttention(v, tp)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = CLIPMLP(v, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    """CLIP: a class token before the patches (a convolution without bias); SigLIP: the patches
    alone (a convolution with a bias). Learned positions, one per position, no interpolation."""

    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.siglip = v.tower == "siglip"
        if not self.siglip:
            self.class_embedding = nn.Parameter(torch.zeros(v.hidden_size))
        self.patch_embedding = nn.Conv2d(
            v.in_channels, v.hidden_size, kernel_size=v.patch_size, stride=v.patch_size, bias=self.siglip
        )
        self.position_embedding = nn.Embedding((v.image_size // v.patch_size) ** 2 + (not self.siglip), v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels[None].to(self.patch_embedding.weight.dtype))[0]  # [hidden, h, w]
        x = patches.flatten(1).T
        if not self.siglip:
            x = torch.cat([self.class_embedding[None], x])
        if x.shape[0] != self.position_embedding.num_embeddings:
            extra = int(not self.siglip)
            raise ValueError(
                f"image: {x.shape[0] - extra} patches, the vision tower takes "
                f"{self.position_embedding.num_embeddings - extra}"
            )
        return x + self.position_embedding.weight


class CLIPEncoder(nn.Module):
    def __init__(self, v: VisionSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPLayer(v, tp) for _ in range(v.depth))


class CLIPVisionTransformer(nn.Module):
    """CLIP's tower, or SigLIP's (the same encoder layers; no pre-norm)."""

    def __init__(self, v: VisionSpec, tp: TensorParallel) -> None:
        super().__init__()
        self.spec = v
        self.embeddings = CLIPEmbeddings(v)
        if v.tower == "clip":
            self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)  # sic: HF's name
        self.encoder = CLIPEncoder(v, tower_parallel(v.num_heads, tp))
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)  # in checkpoints; LLaVA skips it

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The hidden states of `feature_layer` (HF's hidden_states[i]: 0 is the embeddings)."""
        v = self.spec
        stop = v.feature_layer if v.feature_layer >= 0 else v.depth + 1 + v.feature_layer
        x = self.embeddings(pixels)
        if v.tower == "clip":
            x = self.pre_layrnorm(x)
        for layer in self.encoder.layers[:stop]:
            x = layer(x)
        return x[1:] if v.feature_select == "default" else x


class LlavaProjector(nn.Module):
    def __init__(self, v: VisionSpec) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(v.hidden_size, v.out_hidden_size, bias=v.projector_bias)
        self.act = _activation(v.projector_act)
        self.linear_2 = nn.Linear(v.out_hidden_size, v.out_hidden_size, bias=v.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The decoder, the CLIP or SigLIP tower (`vision_tower`) and the projector (`multi_modal_projector`)."""

    def __init__(self, spec, ops=None, tp=None, quant=None, max_model_len=None) -> None:
        super().__init__(spec, ops, tp, quant, max_model_len)
        self.vision_tower = CLIPVisionTransformer(spec.vision, self.tp)
        self.multi_modal_projector = LlavaProjector(spec.vision)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = self.model.embed(input_ids)
        if mm_embeds is not None:
            x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
        return self.forward_embeds(x, positions, kv_caches, meta)

    def encode_image(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower.features(pixels))

    def checkpoint_targets(self, hf_name: str) -> list[tuple[str, int | None]]:
        name = _our_name(hf_name)
        if name.endswith("position_ids") or name.startswith("vision_tower.head."):
            return []  # a buffer older checkpoints saved; SigLIP's pooling head (LLaVA never runs it)
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return vision_targets(self, name)
        return super().checkpoint_targets(name)


def _our_name(hf_name: str) -> str:
    """transformers 5 (model.language_model., model.vision_tower.) and 4.x (language_model.model.,
    vision_tower.vision_model.) names, as ours."""
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if hf_name.startswith(old):
            hf_name = new + hf_name.removeprefix(old)
            break
    return hf_name.replace("vision_tower.vision_model.", "vision_tower.")
