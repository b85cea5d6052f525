"""Weights into a model: HF safetensors checkpoints (single or sharded) or random (dummy)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zllm.workers.models.llama import LlamaForCausalLM

_INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names, else every *.safetensors."""
    root = Path(model_dir)
    index = root / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model: {index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {root} (use load_format='dummy' for random weights)")
    return files


def load_safetensors(model: LlamaForCausalLM, model_dir: str) -> None:
    """Copy every checkpoint tensor into its (slice of a) parameter; fail on gaps and mismatches."""
    params = dict(model.named_parameters())
    expected = set(model.expected_checkpoint_tensors())
    loaded: set[tuple[str, int | None]] = set()
    for path in checkpoint_files(model_dir):
        with _open_safetensors(path) as f:
            for hf_name in f.keys():
                target = model.checkpoint_targets(hf_name)
                if target is None:
                    continue
                name, shard = target
                if target in loaded:
                    raise ValueError(f"model: {path}: tensor {hf_name!r} appears a second time in the checkpoint")
                if name not in params:
                    raise ValueError(f"model: {path}: tensor {hf_name!r} matches no parameter of the model")
                dest = model.parameter_slice(params[name], name, shard)
                tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"model: {path}: tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(target)
    missing = sorted(model.checkpoint_name(name, shard) for name, shard in expected - loaded)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"model: checkpoint in {model_dir} lacks tensor(s) {', '.join(missing[:8])}{more}")


def _open_safetensors(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # safetensors raises its own error types for a bad header
        raise ValueError(f"model: {path} is not a readable safetensors file: {error}") from None


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights of the right shape, drawn where they live: N(0, 0.02) matrices, unit norms."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        device = param.device
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        param.data.normal_(0.0, 0.02, generator=generators[device])
