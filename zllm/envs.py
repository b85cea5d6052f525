"""Every ZLLM_* environment variable the package reads, named, typed and documented in one place.

A setting is read when it is asked for (`envs.ZLLM_CACHE`), so a value set after import (a test's
monkeypatch, a child process's environment) is seen. Modules that turn a setting into a module
constant at import time say so where they do it. docs/configuration.md lists these settings; a test
checks that the two agree and that no other module reads a ZLLM_* variable itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Setting:
    """One environment variable: how its text becomes a value, the value when unset or empty."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    empty_is_a_value: bool = False  # set but empty is parsed, not the default (ZLLM_GEMV_BOUND="")


def _switch(raw: str) -> bool:
    """An on/off setting: "0" turns it off, anything else leaves it on (the A/B switches)."""
    return raw.strip() != "0"


_ON_WORDS = ("1", "true", "yes", "on")
_OFF_WORDS = ("0", "false", "no", "off")


def _on(raw: str) -> bool:
    """An opt-in setting: off unless set to 1, true, yes or on."""
    return raw.strip().lower() in _ON_WORDS


def _on_off_or_auto(raw: str) -> bool | None:
    """A switch with a default that depends on the run: "0"/off/false/no is off, "1"/on/true/yes
    is on, "auto" (or unset) leaves it to the code that reads it; anything else is refused."""
    value = raw.strip().lower()
    if value in _ON_WORDS:
        return True
    if value in _OFF_WORDS:
        return False
    if value == "auto":
        return None
    raise ValueError("expected 1, 0 or auto")


def _text(raw: str) -> str:
    return raw.strip()


def _verbatim(raw: str) -> str | None:
    """Text kept exactly as set (a secret: spaces are part of it, so a key of spaces still asks for
    that key); only the empty string means unset."""
    return raw or None


DECODE_ATTENTION_BUILDS = ("classic", "pipe", "pipe3")


def _decode_build(raw: str) -> str:
    """One of DECODE_ATTENTION_BUILDS."""
    value = raw.strip().lower()
    if value not in DECODE_ATTENTION_BUILDS:
        raise ValueError(f"not one of {DECODE_ATTENTION_BUILDS}")
    return value


def _spin_seconds(raw: str) -> float:
    """Seconds from 0 (no limit) to a day; NaN and infinities are refused."""
    value = float(raw)
    if not 0.0 <= value <= 86400.0:  # NaN fails too
        raise ValueError("expected seconds from 0 (wait forever) to 86400")
    return value


def _json_object(raw: str) -> dict[str, float]:
    """A JSON object of numbers (Ray resources: {"GPU": 1, "accelerator_type:H100": 0.001})."""
    value = json.loads(raw)
    if not isinstance(value, dict) or not all(isinstance(v, int | float) for v in value.values()):
        raise ValueError(f"not a JSON object of numbers: {raw!r}")
    return {str(k): float(v) for k, v in value.items()}


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        # -- every process
        Setting(
            "ZLLM_CACHE", _text, None, "Where converted models live (default $XDG_CACHE_HOME/zllm or ~/.cache/zllm)."
        ),
        Setting(
            "ZLLM_LOG_LEVEL",
            _text,
            None,
            "Log level of every zllm process (DEBUG, INFO, ...); vllm-launch sets it to --log-level when unset.",
        ),
        Setting(
            "ZLLM_DEBUG_HANG_S",
            _text,
            None,
            "Seconds: a worker dumps all its threads' stacks to stderr this often (debugging a hang; a bad value warns).",
        ),
        Setting(
            "ZLLM_GC_FREEZE",
            _on,
            True,
            "1/true: each server process, and the offline LLM on CUDA until it shuts down, freezes its start-up heap out of "
            "the garbage collector's walks (gc.freeze).",
        ),
        Setting(
            "ZLLM_GC_DEFER_OLD",
            _on,
            True,
            "1/true: LLM.generate keeps the collector's young passes but defers its oldest-generation passes to "
            "its end.",
        ),
        # -- frontend
        Setting("ZLLM_API_KEY", _verbatim, None, "The API key --api-key defaults to.", empty_is_a_value=True),
        Setting(
            "ZLLM_ALLOW_RUNTIME_LORA_UPDATING",
            _on,
            False,
            "1/true: /v1/load_lora_adapter and /v1/unload_lora_adapter are served (with --enable-lora).",
        ),
        # -- engine core
        Setting(
            "ZLLM_STEP_TRACE",
            _text,
            None,
            "A path prefix: each engine core writes one JSON line per step to PATH.dp<rank>.jsonl (off when unset).",
        ),
        Setting(
            "ZLLM_RAY_RANK_RESOURCES",
            _json_object,
            None,
            'With the Ray backend: the Ray resources of one rank (its placement-group bundle), JSON, e.g. {"GPU": 1}.',
        ),
        # -- worker: kernels and their A/B switches
        Setting("ZLLM_KERNELS", _text, "auto", "CUDA kernels: auto (prebuilt, else NVRTC), prebuilt, or nvrtc."),
        Setting("ZLLM_CSRC_DIR", _text, None, "Where the CUDA sources are (default: found beside the package)."),
        Setting("ZLLM_CSRC_BUILD", _text, None, "A csrc build directory searched first for prebuilt kernels."),
        Setting("ZLLM_CPU_KERNELS", _switch, True, "0: the CPU attention kernels are not built; torch's path runs."),
        Setting(
            "ZLLM_DECODE_ATTENTION",
            _decode_build,
            "pipe",
            "Which paged decode attention kernel runs: pipe (cp.async K/V tiles, 2 stages; the default), pipe3 "
            "(3 stages) or classic; pipe* fall back to classic for layers they do not build (A/B switch).",
        ),
        Setting(
            "ZLLM_DECODE_WIDE_PARTITIONS",
            _switch,
            True,
            "0: large decode batches keep 512-token attention partitions instead of 1024 (A/B switch).",
        ),
        Setting(
            "ZLLM_DECODE_PARTITION_LOOP",
            _switch,
            True,
            "0: the pipelined decode attention always launches a block for every partition of the block"
            " table's capacity (max_model_len), instead of one wave of blocks that claim every partition of"
            " the batch where its contexts are split and it has 9 to 1024 rows of Llama-3-8B's heads (A/B switch).",
        ),
        Setting("ZLLM_PACKED_PREFILL", _switch, True, "0: prefill attention runs a request at a time (A/B switch)."),
        Setting(
            "ZLLM_GEMV",
            _switch,
            True,
            "0: single rows (and 2-8 rows) go to cuBLAS too, not the GEMV kernels (A/B switch).",
        ),
        Setting(
            "ZLLM_GEMV_BOUND",
            _text,
            "b6",
            "Which launch bound the bf16 GEMV kernels are built with (empty: the one-warp-per-row kernel).",
            empty_is_a_value=True,
        ),
        Setting(
            "ZLLM_NGRAM_ADAPTIVE",
            _on,
            False,
            "1/true: a request's n-gram draft is one token more than it last kept, not num_speculative_tokens.",
        ),
        Setting(
            "ZLLM_GEMV_ROWS",
            _switch,
            True,
            "0: 2-8 rows go to cuBLAS, not the GEMV-rows kernels (A/B switch; ZLLM_GEMV=0 turns both off).",
        ),
        Setting(
            "ZLLM_GEMV_ROWS_VARIANT",
            _text,
            "",
            "A build of the 2-8-row GEMV to run for every such product (mma_g2_s4, fma_s2, ...; A/B switch).",
        ),
        Setting(
            "ZLLM_FP8_GEMV",
            _text,
            "",
            "An FP8 GEMV build variant to use for bf16 per-row layers (A/B switch; matvec.fp8_gemv_variants()).",
        ),
        Setting(
            "ZLLM_FP8_GEMV_WIDE",
            _text,
            "",
            "MIN_N:VARIANT: bf16 per-row FP8 layers of at least MIN_N output rows run that build instead (A/B switch).",
        ),
        Setting(
            "ZLLM_PDL",
            _switch,
            True,
            "0: the batch-1 decode kernels launch as before, not with programmatic dependent launch (sm_90+; A/B switch).",
        ),
        Setting(
            "ZLLM_FUSED_ACT_GEMV",
            _switch,
            True,
            "0: at batch 1 a gate_up projection (FP8 or dense) and its gated activation run as two kernels, not one (A/B switch).",
        ),
        Setting(
            "ZLLM_FUSED_ROPE_GEMV",
            _switch,
            True,
            "0: at batch 1 the q/k/v projection, then rotary and the KV cache write, run as two kernels, not one (A/B switch).",
        ),
        Setting(
            "ZLLM_PDL_ATTENTION",
            _switch,
            False,
            "1: the paged decode attention and its reduce launch with programmatic dependent launch too (experiment).",
        ),
        Setting(
            "ZLLM_LORA_KERNELS",
            _switch,
            True,
            "0: LoRA runs its torch path on the GPU too (rows grouped on the host, CUDA graphs off; A/B switch).",
        ),
        Setting(
            "ZLLM_LORA_FUSED_EXPAND",
            _switch,
            True,
            "0: LoRA's expand runs as its own kernel at decode, not in the GEMV's epilogue (A/B switch).",
        ),
        Setting(
            "ZLLM_ALLREDUCE_NORM",
            _on,
            False,
            "1: at tp > 1 on GPUs with the symmetric-memory all-reduce, o_proj's and down_proj's all-reduce, "
            "the residual add and the next RMSNorm run in one launch (csrc/allreduce_kernels.cu); "
            "read when the model is built. Unverified on a GPU.",
        ),
        Setting(
            "ZLLM_NORM_GEMV",
            _on_off_or_auto,
            None,
            "A batch-1 decode step of a plain Llama-family fp16/bf16 model carries each residual add in the "
            "o and down GEMVs' epilogue and each RMSNorm in the q/k/v and gate_up GEMVs (csrc/gemv_kernels.cu "
            "kAdd, kNorm), the norms' weights folded into the projections at load: two launches a layer "
            "fewer. auto (unset): on where those kernels take every layer (CUDA, fp16/bf16, the default GEMV "
            "builds); 1: on wherever the layers allow it (the CPU too, through the unfused fallbacks: tests); "
            "0: off. Read when the model is loaded.",
        ),
        Setting(
            "ZLLM_ALLREDUCE_LAMPORT",
            _on_off_or_auto,
            None,
            "On GPUs with the symmetric-memory all-reduce, the all-reduces it takes run zllm's "
            "barrier-free Lamport kernel (csrc/allreduce_kernels.cu) instead of PyTorch's one-shot. "
            "auto (unset): on at tp 2 and 4, the sizes verified on GPUs; 1: on at every tp; 0: off. Read at start-up.",
        ),
        Setting(
            "ZLLM_GEMV_PUSH",
            _switch,
            True,
            "0: the norm-carrying batch-1 step's o and down GEMVs store their product for the Lamport "
            "all-reduce to read and push, instead of pushing their rows into every rank's Lamport buffer "
            "from their epilogue (csrc/gemv_kernels.cu _push builds, then lamport_sum_pushed). A/B switch, "
            "read at start-up, agreed by every rank.",
        ),
        Setting(
            "ZLLM_ALLREDUCE_SPIN_TIMEOUT_S",
            _spin_seconds,
            60.0,
            "Seconds the Lamport all-reduce waits for a peer's values before it traps (the worker "
            "then fails instead of hanging); 0 waits forever.",
        ),
        Setting(
            "ZLLM_LORA_NORM_SHRINK",
            _switch,
            True,
            "0: at decode (1-8 rows) the add-RMSNorm before q/k/v and gate/up, and the MLP's gated "
            "activation before down, no longer run that projection's LoRA shrink in their launch (A/B switch).",
        ),
        Setting(
            "ZLLM_LORA_DENSE_ROWS_PER_SLOT",
            float,
            4.0,
            "LoRA on CUDA: launches of this many rows per slot (max_loras) or more run the dense GEMM path "
            "(0: always; inf: never, the kernels only).",
        ),
        Setting(
            "ZLLM_POOLING_CUDA_GRAPHS",
            _on,
            False,
            "1: pooling steps (packed, fp16/bf16) replay CUDA graphs padded to token buckets. Off by default: "
            "on an H100, all-MiniLM-L6-v2 embedded 13,907 inputs/s with them and 20,667 without.",
        ),
        Setting(
            "ZLLM_QUANT_VEC", _switch, True, "0: every row goes through the scalar FP8 quantize kernel (A/B switch)."
        ),
        Setting(
            "ZLLM_ROPE_VEC",
            _switch,
            True,
            "0: the rotary embedding + KV cache store runs its scalar kernel everywhere (A/B switch; on: 16-byte "
            "accesses for 16-bit heads rotated whole).",
        ),
        Setting(
            "ZLLM_MOE_GEMV_PAIRS", float, 0.5, "MoE: (token, slot) pairs per expert up to which GEMVs run (0: never)."
        ),
        Setting(
            "ZLLM_MOE_GROUPED_MM_ROWS", float, 4.0, "MoE: rows per expert from which torch._grouped_mm runs (0: never)."
        ),
        Setting(
            "ZLLM_FP8_BLOCKS",
            _text,
            "auto",
            "Block-FP8 MoE/MLA checkpoints (DeepSeek-V3's): keep (FP8 weights in memory, dequantized per layer "
            "before its product), dequantize (to the model dtype at load), auto (keep on CUDA, dequantize on CPU).",
        ),
        # -- tests only
        Setting(
            "ZLLM_TEST_FAIL_PROMPT_TOKEN",
            int,
            None,
            "TEST ONLY: a worker fails any request whose prompt holds this token id.",
        ),
    )
}


def read(name: str) -> Any:
    """The setting's value now: its default when the variable is unset or (for most) empty."""
    setting = SETTINGS[name]
    raw = os.environ.get(name)
    if raw is None or (not raw.strip() and not setting.empty_is_a_value):
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None


def set_default(name: str, value: str) -> None:
    """Set a setting for this process and the children it starts, unless the environment has it already."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not a zllm setting (zllm/envs.py)")
    os.environ.setdefault(name, value)


def __getattr__(name: str) -> Any:
    if name in SETTINGS:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *SETTINGS])
