"""Pooling models (embeddings, classifiers, cross-encoder scores): what every process shares.

Plain Python (no torch). `PoolingParams` travels with a request from the frontend to the workers;
`PoolerConfig` is what a checkpoint declares about its output, resolved once by
`EngineConfig.create` (sentence-transformers' `modules.json` and `1_Pooling/config.json`, or the
architecture's default); `finish_embedding` / `finish_scores` are the frontend's last step on
the vector a worker pooled.

The split: the worker pools (mean / CLS / last token over the final hidden states, then the
classifier head where there is one) and sends that raw fp32 vector; the frontend normalizes,
truncates (Matryoshka `dimensions`) or applies the activation, per request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from zllm.sampling_params import SamplingParams, check_truncate_prompt_tokens

POOLING_TASKS = ("embed", "classify", "score", "encode")
POOLING_TYPES = ("mean", "cls", "last")
# What a pooling request carries as SamplingParams: nothing is sampled or detokenized.
POOLING_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `PoolingParams`: what a pooling request wants back.

    task: "embed" (a vector), "classify" (class probabilities), "score" (a cross-encoder's
    relevance of a pair), "encode" (the raw pooled vector). normalize: None follows the model
    (sentence-transformers' Normalize module); dimensions: keep the first n (Matryoshka models),
    then normalize. token_type_ids: a text pair's segment ids (BERT cross-encoders), set by the
    frontend from the tokenizer. truncate_prompt_tokens: as SamplingParams' (vLLM's), the last k
    tokens of the input (of a pair's joined tokens, and their token types)."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    activation: bool | None = None  # classify/score: softmax / sigmoid over the logits (default on)
    token_type_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None  # keep the input's last k tokens; -1: max_model_len

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task: must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"dimensions: must be a positive integer, got {self.dimensions!r}")


@dataclass(slots=True)
class PoolerConfig:
    """How a pooling model's hidden states become its output, as the checkpoint declares it.

    kind: "embed" (a vector of hidden_size) or "classify" (a head of num_labels logits);
    pooling_type: mean / cls / last; normalize: the embedding is L2-normalized by default."""

    kind: str = "embed"
    pooling_type: str = "cls"
    normalize: bool = False
    num_labels: int = 0
    max_seq_length: int = 0  # sentence-transformers' truncation length; 0: none declared
    hidden_size: int = 0  # an embedding's width
    matryoshka: bool = False  # config.json's is_matryoshka / matryoshka_dimensions: `dimensions` allowed
    labels: list[str] = field(default_factory=list)  # a classifier's id2label, in label order
    # A generative decoder converted to a classifier from its LM head's rows (vLLM's
    # `classifier_from_token` / `method`, zllm/workers/models/decoder_pooling.py): the tokens' ids
    # and "from_2_way_softmax" (one logit, yes - no) or "no_post_processing" (one per token).
    classifier_token_ids: list[int] = field(default_factory=list)
    classifier_method: str = ""

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this model serves."""
        if self.kind == "classify":
            return ("classify", "score", "encode") if self.num_labels >= 1 else ("classify", "encode")
        return ("embed", "encode")  # scored by the cosine of two embeddings (LLM.score, /score)


def read_pooler_config(model_dir: str, kind: str, default_pooling: str, num_labels: int = 0) -> PoolerConfig:
    """The pooler a model directory declares: sentence-transformers' modules (a Pooling module's
    mode, a Normalize module) where it has them, else the architecture's default."""
    root = Path(model_dir)
    config = PoolerConfig(kind=kind, pooling_type=default_pooling, num_labels=num_labels)
    modules = _read_json(root / "modules.json")
    # Without sentence-transformers' modules an embedding is normalized, as vLLM's embed pooler does.
    config.normalize = kind == "embed" and not isinstance(modules, list)
    if isinstance(modules, list):
        for module in modules:
            module_type = str(module.get("type", ""))
            if module_type.endswith(".Pooling"):
                config.pooling_type = _pooling_mode(root / module.get("path", "") / "config.json", default_pooling)
            elif module_type.endswith(".Normalize"):
                config.normalize = True
    model_config = _read_json(root / "config.json") or {}
    config.hidden_size = int(model_config.get("hidden_size", 0) or 0)
    config.matryoshka = bool(model_config.get("is_matryoshka") or model_config.get("matryoshka_dimensions"))
    if kind == "classify":
        id2label = model_config.get("id2label") or {}
        config.labels = [str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels)]
    bert_config = _read_json(root / "sentence_bert_config.json")
    if isinstance(bert_config, dict) and isinstance(bert_config.get("max_seq_length"), int):
        config.max_seq_length = bert_config["max_seq_length"]
    return config


def declares_pooling(model_dir: str) -> bool:
    """A sentence-transformers directory (a Pooling module in modules.json): an embedding model
    whatever its architecture (Qwen3-Embedding ships as Qwen3ForCausalLM)."""
    modules = _read_json(Path(model_dir) / "modules.json")
    return isinstance(modules, list) and any(str(m.get("type", "")).endswith(".Pooling") for m in modules)


# vLLM's ways of making a generative decoder's classifier from rows of its LM head (Qwen3-Reranker,
# mxbai-rerank-v2: "from_2_way_softmax"; bge-reranker-v2-gemma: "no_post_processing").
CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")
# The keys of vLLM's hf_overrides that zllm honours (and reads from config.json too): those that
# turn a generative decoder into a sequence classifier.
CLASSIFIER_KEYS = ("architectures", "classifier_from_token", "method", "is_original_qwen3_reranker", "num_labels")


def classifier_settings(model_dir: str, overrides: dict) -> dict:
    """The classifier keys of config.json, under those of hf_overrides (which win)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"hf_overrides: must be a JSON object (a dict), got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(CLASSIFIER_KEYS))
    if unknown:
        raise ValueError(f"hf_overrides: {unknown} not supported; zllm honours {CLASSIFIER_KEYS}")
    model_config = _read_json(Path(model_dir) / "config.json") or {}
    settings = {k: model_config[k] for k in CLASSIFIER_KEYS[1:] if k in model_config}
    settings.update(overrides)
    return settings


def converted_classifier(model_dir: str, tokenizer_dir: str, settings: dict) -> tuple[int, list[int], str]:
    """A generative decoder served with --convert classify: (num_labels, classifier token ids,
    method). Without classifier_from_token the checkpoint's own `score.weight` is the head, of
    config.json's num_labels (transformers' default 2), as vLLM's as_seq_cls_model loads it."""
    tokens = settings.get("classifier_from_token")
    method = "from_2_way_softmax" if settings.get("is_original_qwen3_reranker") else settings.get("method", "")
    if not tokens:
        if method:
            raise ValueError(f"hf_overrides: method {method!r} needs classifier_from_token")
        if "num_labels" in settings:
            return int(settings["num_labels"]), [], ""
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(model_dir).num_labels), [], ""
    if method not in CLASSIFIER_METHODS:
        raise ValueError(f"hf_overrides: method must be one of {CLASSIFIER_METHODS} with classifier_from_token")
    if not isinstance(tokens, list) or (method == "from_2_way_softmax" and len(tokens) != 2):
        raise ValueError("hf_overrides: classifier_from_token: from_2_way_softmax takes two tokens [false, true]")
    token_ids = _token_ids(tokenizer_dir, tokens)
    return (1 if method == "from_2_way_softmax" else len(token_ids)), token_ids, method


def _token_ids(tokenizer_dir: str, tokens: list) -> list[int]:
    """Each token's id in the model's vocabulary (an int is taken as an id)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = []
    for token in tokens:
        token_id = token if isinstance(token, int) else tokenizer.convert_tokens_to_ids(token)
        unknown = token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token)
        if unknown or not 0 <= token_id < len(tokenizer):
            raise ValueError(f"hf_overrides: classifier_from_token: {token!r} is not a token of the model's vocabulary")
        ids.append(int(token_id))
    return ids


def _pooling_mode(path: Path, default: str) -> str:
    config = _read_json(path)
    if not isinstance(config, dict):
        return default
    if config.get("pooling_mode_cls_token"):
        return "cls"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    if config.get("pooling_mode_lasttoken"):
        return "last"
    modes = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    raise ValueError(f"model: {path}: pooling mode {modes} is not supported; supported: {POOLING_TYPES}")


def _read_json(path: Path):
    if not path.is_file():
        return None
    return json.loads(path.read_text())


# ---- the frontend's last step --------------------------------------------------------------------


def check_pooling(params: PoolingParams, pooler: PoolerConfig) -> None:
    """What depends on the model: its tasks, and `dimensions` only where it is Matryoshka."""
    if params.task not in pooler.tasks:
        raise ValueError(f"task: {params.task!r} is not served by this model; it serves {pooler.tasks}")
    if params.dimensions is not None:
        if not pooler.matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka representations")
        if params.dimensions > pooler.hidden_size:
            raise ValueError(f"dimensions: {params.dimensions} exceeds the model's {pooler.hidden_size}")


def finish_pooled(rows: bytes, params: PoolingParams, pooler: PoolerConfig) -> list[list[float]]:
    """The workers' raw float32 vectors (rows of equal width, concatenated) as the request asked:
    an embedding truncated (`dimensions`) then L2-normalized (the model's Normalize module, or the
    request's `normalize`), as sentence-transformers does; a classifier's logits as probabilities
    (softmax over several labels, sigmoid over one, as vLLM and CrossEncoder do); `encode` raw.
    Vectorized over the rows: the offline path finishes a whole batch at once."""
    import numpy as np

    width = pooler.num_labels if pooler.kind == "classify" else pooler.hidden_size
    return finished_rows(np.frombuffer(rows, dtype="<f4").reshape(-1, width), params, pooler).tolist()


def finished_rows(vectors, params: PoolingParams, pooler: PoolerConfig):
    """`finish_pooled` over a float32 array [inputs, width] (a pooling batch's vectors): the
    finished rows as a float64 array."""
    import numpy as np

    matrix = vectors.astype(np.float64)
    if params.task == "embed":
        matrix = _embedding_rows(matrix, params, pooler)
    elif params.task in ("classify", "score") and params.activation is not False:
        matrix = _probabilities(matrix)
    return matrix


def _embedding_rows(matrix, params: PoolingParams, pooler: PoolerConfig):
    import numpy as np

    if params.dimensions is not None:
        matrix = matrix[:, : params.dimensions]
    if pooler.normalize if params.normalize is None else params.normalize:
        matrix = matrix / np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    return matrix


def _probabilities(logits):
    import numpy as np

    if logits.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    exps = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exps / exps.sum(axis=1, keepdims=True)


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two embeddings (a bi-encoder's score of a pair)."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / max(norms, 1e-12)
