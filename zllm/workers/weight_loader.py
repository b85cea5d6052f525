"""Weights into a model: HF safetensors checkpoints (single or sharded) or random (dummy)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from zllm.model_files import TORCH_CHECKPOINT_FILE, checkpoint_files
from zllm.quantization import BLOCK
from zllm.workers.fp8 import E4M3, dequantize
from zllm.workers.models.llama import LlamaForCausalLM
from zllm.workers.parallel_layers import LoadTarget


def load_safetensors(model: LlamaForCausalLM, model_dir: str, torch_file: bool = False) -> None:
    """Copy this rank's part of every checkpoint tensor into its parameter; fail on gaps and
    mismatches. Only the needed region of each tensor is read from disk (safetensors).
    torch_file: a pytorch_model.bin is read too, where the directory has no safetensors."""
    params = dict(model.named_parameters())
    expected = set(model.expected_checkpoint_tensors())
    loaded: set[tuple[str, int | None]] = set()
    files = checkpoint_files(model_dir, torch_file)
    scales = _BlockScales(files) if getattr(model.spec, "dequantize_fp8_blocks", False) else None
    for path in files:
        with _open_safetensors(path) as opened:
            f = opened if scales is None else _DequantizedFile(opened, scales, path)
            for hf_name in f.keys():
                for target in model.checkpoint_targets(hf_name):  # several: a tensor fused in the checkpoint
                    name, shard = target
                    if target in loaded:
                        raise ValueError(f"model: {path}: tensor {hf_name!r} appears a second time in the checkpoint")
                    if name not in params:
                        raise ValueError(f"model: {path}: tensor {hf_name!r} matches no parameter of the model")
                    where = model.load_target(name, shard)
                    where.fill(_read_region(f, hf_name, where, path))
                    loaded.add(target)
    # A tensor fused in the checkpoint fills several shards: named once.
    missing = sorted({model.checkpoint_name(name, shard) for name, shard in expected - loaded})
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"model: checkpoint in {model_dir} lacks tensor(s) {', '.join(missing[:8])}{more}")


def _read_region(f, hf_name: str, where: LoadTarget, path: Path) -> torch.Tensor:
    """The part of checkpoint tensor `hf_name` that `where` takes, its shape checked first."""
    stored = f.get_slice(hf_name)
    shape = tuple(stored.get_shape())
    if where.full_shape is None:  # one value: a per-tensor scale, stored as [] or [1]
        if math.prod(shape) != 1:
            raise ValueError(f"model: {path}: tensor {hf_name!r} has shape {shape}, expected one value")
        return f.get_tensor(hf_name).reshape(1)
    if shape != where.full_shape:
        raise ValueError(f"model: {path}: tensor {hf_name!r} has shape {shape}, expected {where.full_shape}")
    return stored[where.region]


_SCALE_SUFFIX = "_scale_inv"  # X.weight's block scales: X.weight_scale_inv


class _BlockScales:
    """Where each `*.weight_scale_inv` of a checkpoint lives (a scale may sit in another shard
    than its weight), read on demand."""

    def __init__(self, files: list[Path]) -> None:
        self.path_of: dict[str, Path] = {}
        for path in files:
            with _open_safetensors(path) as f:
                self.path_of |= {name: path for name in f.keys() if name.endswith(_SCALE_SUFFIX)}

    def read(self, weight_name: str, path: Path) -> torch.Tensor:
        name = weight_name + _SCALE_SUFFIX
        if name not in self.path_of:
            raise ValueError(f"model: {path}: float8 tensor {weight_name!r} has no {name!r} in the checkpoint")
        with _open_safetensors(self.path_of[name]) as f:
            return f.get_tensor(name)


class _Loaded:
    """A tensor already in memory, read as safe_open's slices are."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, region) -> torch.Tensor:
        return self.tensor[region]


class _DequantizedFile:
    """A shard of a 128x128 block-scaled FP8 checkpoint (quant_method fp8, DeepSeek-V3's) read
    as the model dtype's values: each float8_e4m3fn `X.weight` is its fp32 value times its
    block's `X.weight_scale_inv` (fp8.dequantize, transformers' arithmetic), the scales
    themselves hidden. For the models whose layers take no FP8 (ModelSpec.dequantize_fp8_blocks:
    MLA's absorbed kv_b_proj and the MoE experts); each rank reads whole weights, then its region."""

    def __init__(self, f, scales: _BlockScales, path: Path) -> None:
        self.f, self.scales, self.path = f, scales, path

    def keys(self) -> list[str]:
        return [name for name in self.f.keys() if not name.endswith(_SCALE_SUFFIX)]

    def _fp8(self, name: str) -> bool:
        return self.f.get_slice(name).get_dtype() == "F8_E4M3"

    def get_slice(self, name: str):
        return _Loaded(self.get_tensor(name)) if self._fp8(name) else self.f.get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self.f.get_tensor(name)
        if tensor.dtype != E4M3:
            return tensor
        scale = self.scales.read(name, self.path).float()
        expected = tuple(-(-n // BLOCK) for n in tensor.shape)
        if tensor.dim() != 2 or tuple(scale.shape) != expected:
            raise ValueError(
                f"model: {self.path}: {name!r} {tuple(tensor.shape)} needs 128x128 block scales {expected}, "
                f"got {tuple(scale.shape)}"
            )
        return dequantize(tensor, scale, block=True)


def finish_loading(model: LlamaForCausalLM) -> None:
    """Let every layer derive what it keeps from its loaded tensors (e.g. one static FP8 input
    scale from its fused parts')."""
    for module in model.modules():
        if hasattr(module, "finish_loading"):
            module.finish_loading()


def _open_safetensors(path: Path):
    if path.name == TORCH_CHECKPOINT_FILE:
        return _TorchFile(path)
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as error:  # safetensors raises its own error types for a bad header
        raise ValueError(f"model: {path} is not a readable safetensors file: {error}") from None


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights of the right shape: uniform noise of std 0.02 for matrices, ones for norms.

    Each element is a hash of (seed, tensor name, its index in the full checkpoint tensor), computed
    only for this rank's part: a dummy model is the same model at every tensor-parallel size (so
    tp N can be checked against tp 1 without a checkpoint), and no rank materialises a full tensor.
    """
    for name, shard in model.expected_checkpoint_tensors():
        where = model.load_target(name, shard)
        if name.endswith("norm.weight"):
            where.dest.fill_(1.0)
        elif where.dest.dtype == torch.uint8:  # MXFP4 experts (models/gpt_oss.py): random codes
            _fill_mxfp4(where.dest, name, _stable_seed(seed, name, shard))
        elif (where := _as_matrix(where)).store is None:
            _fill_hashed(where.dest, where, _stable_seed(seed, name, shard))
        else:  # quantized while loading: the same values, then quantized as a checkpoint's would be
            values = torch.empty(where.dest.shape, dtype=torch.float32, device=where.dest.device)
            _fill_hashed(values, where, _stable_seed(seed, name, shard))
            where.fill(values)


_MXFP4_DUMMY_EXPONENT = 127 - 6  # scales of 2^-6: E2M1 values up to 6 give weights up to ~0.09


def _fill_mxfp4(dest: torch.Tensor, name: str, seed: int) -> None:
    """Stored MXFP4: hashed bytes for the blocks (two random E2M1 codes each), one small
    exponent for the scales."""
    if name.endswith("_scales"):
        dest.fill_(_MXFP4_DUMMY_EXPONENT)
        return
    flat = torch.arange(dest.numel(), dtype=torch.int64, device=dest.device)
    dest.view(-1).copy_(_hash32(flat ^ (seed & _MASK32)) & 0xFF)


def _as_matrix(where: LoadTarget) -> LoadTarget:
    """A whole tensor of more than two dimensions (a vision tower's convolution) as rows x columns
    (a shard keeps its region: its hash indices must be the full tensor's)."""
    if where.dest.dim() <= 2 or where.store is not None or not all(r == slice(None) for r in where.region):
        return where
    rows = where.dest.shape[0]
    columns = where.dest[0].numel()
    return LoadTarget(where.dest.view(rows, columns), (rows, columns), (slice(None), slice(None)))


_DUMMY_STD = 0.02
_CHUNK_ELEMENTS = 1 << 24  # bounds the int64 scratch per step (128 MiB)


def _fill_hashed(dest: torch.Tensor, where: LoadTarget, seed: int) -> None:
    """dest (where.dest or a tensor of its shape) <- the hashed values of where's region."""
    if dest.dim() > 2 and all(r == slice(None) for r in where.region):  # a whole stacked tensor (GPT-OSS)
        full = where.full_shape
        flat_where = LoadTarget(dest.view(-1, dest.shape[-1]), (math.prod(full[:-1]), full[-1]), (slice(None),) * 2)
        _fill_hashed(flat_where.dest, flat_where, seed)
        return
    if dest.dim() == 1:  # a vector is one row of the hash's index space
        dest, full_cols, row0, col0 = dest.view(1, -1), where.full_shape[0], 0, where.region[0].start or 0
    else:
        full_cols = where.full_shape[1]
        row0, col0 = where.region[0].start or 0, where.region[1].start or 0 if len(where.region) > 1 else 0
    rows, cols = dest.shape
    device = dest.device
    col_index = torch.arange(col0, col0 + cols, dtype=torch.int64, device=device)
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    for first in range(0, rows, step):
        count = min(step, rows - first)
        row_index = torch.arange(row0 + first, row0 + first + count, dtype=torch.int64, device=device)
        flat = row_index[:, None] * full_cols + col_index[None, :]
        mixed = _hash32(_hash32(flat ^ (seed & _MASK32)) ^ (flat >> 32) ^ (seed >> 32))
        uniform = mixed.to(torch.float32) / 2.0**32
        dest[first : first + count].copy_((uniform - 0.5) * (_DUMMY_STD * 12**0.5))


_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """An integer mixing function on int64 tensors holding 32-bit values (multipliers < 2**31 so
    no product overflows int64)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x6C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def _stable_seed(seed: int, name: str, shard: int | None) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def read_whole_tensor(model_dir: str, name: str, torch_file: bool = False) -> torch.Tensor:
    """One checkpoint tensor, whole (a small one: EAGLE-3's d2t)."""
    for path in checkpoint_files(model_dir, torch_file):
        with _open_safetensors(path) as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise ValueError(f"model: checkpoint in {model_dir} lacks tensor {name}")


class _TorchFile:
    """A pytorch_model.bin read like a safetensors file (keys, get_slice, get_tensor). Loaded
    with weights_only: tensors and plain containers only, no code from the file runs; memory-mapped,
    so a region read copies only that region."""

    def __init__(self, path: Path) -> None:
        try:
            self.tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # torch raises several types for a file it cannot read
            raise ValueError(f"model: {path} is not a readable PyTorch weights file: {error}") from None
        if not isinstance(self.tensors, dict):
            raise ValueError(f"model: {path} holds no state dict of tensors")

    def __enter__(self) -> _TorchFile:
        return self

    def __exit__(self, *exc) -> None:
        self.tensors = {}

    def keys(self):
        return self.tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> _TorchSlice:
        return _TorchSlice(self.tensors[name])


class _TorchSlice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, region) -> torch.Tensor:
        return self.tensor[region]
