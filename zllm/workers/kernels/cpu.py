"""zllm's CPU kernels (csrc/cpu/*.c), built with the system C compiler on first use and called
through ctypes on torch tensors' data pointers.

The build is cached under <zllm cache>/cpu_kernels/<key>/, the key hashing the source, the
compiler, its flags and this machine's CPU (the library is built for -march=native). A file
lock makes concurrent workers (tensor-parallel ranks, test servers) build it once. Without a
compiler, or when the build or load fails, `paged_attention_decode` returns False after one
warning and the caller keeps its torch path; ZLLM_CPU_KERNELS=0 turns the kernels off. The
C source is found beside the CUDA ones (kernels.loader.csrc_dir: $ZLLM_CSRC_DIR moves both).

The library is linked against libgomp, the OpenMP runtime torch's CPU build loads under the
same name, so the kernel's threads and torch's are one pool; each call passes torch's thread
count, so ranks that cap their threads are respected.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from zllm import envs
from zllm.model_files import cache_root
from zllm.workers.kernels.loader import csrc_dir

logger = logging.getLogger(__name__)

SOURCE_NAME = "paged_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


class CpuKernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded."""


def source_path() -> Path:
    return csrc_dir() / "cpu" / SOURCE_NAME


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "vendor_id", "cpu family", "model\t")
    lines = [line for line in text.splitlines() if line.startswith(wanted)]
    return "\n".join(dict.fromkeys(lines))  # every core repeats them


def _compiler_version(cc: str) -> str:
    result = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return result.stdout


def build(cache_dir: Path | None = None) -> Path:
    """Compile the library (once per source/compiler/flags/CPU) and return its path."""
    cc = compiler()
    if cc is None:
        raise CpuKernelBuildError("no C compiler found (set CC, or install gcc)")
    source = source_path().read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, _compiler_version(cc).encode(), " ".join(CFLAGS).encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    out_dir = (cache_dir or cache_root() / "cpu_kernels") / key
    library = out_dir / "libzllm_cpu.so"
    if library.is_file():
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if not library.is_file():
            _compile(cc, out_dir, library)
    return library


def _compile(cc: str, out_dir: Path, library: Path) -> None:
    partial = out_dir / f"libzllm_cpu.so.{os.getpid()}.tmp"
    command = [cc, *CFLAGS, "-o", str(partial), str(source_path())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise CpuKernelBuildError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
    partial.replace(library)  # atomic: a reader never sees a half-written library


def _load() -> ctypes.CDLL | None:
    """The loaded library, or None (warned once) where it cannot be built or loaded."""
    global _library, _tried
    with _lock:
        if not _tried:
            _tried = True
            if not envs.ZLLM_CPU_KERNELS:
                return None
            try:
                _library = _declare(ctypes.CDLL(str(build())))
            except (CpuKernelBuildError, OSError, subprocess.SubprocessError) as exc:
                logger.warning("zllm CPU kernels unavailable, using the torch attention path: %s", exc)
        return _library


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _NAMES.values():
        fn = getattr(library, f"paged_attention_decode_{name}")
        f32 = ctypes.c_float
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, f32, i64, f32, ctypes.c_int]
        fn.restype = ctypes.c_int
    return library


def is_available() -> bool:
    return _load() is not None


def _supported(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in _NAMES
        and out.dtype == query.dtype == kv_cache.dtype
        and query.stride(-1) == out.stride(-1) == kv_cache.stride(-1) == 1
    )


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> bool:
    """out[s] = attention of query[s] ([seqs, heads, head_dim]) over its first seq_lens[s] cached
    tokens (kv_cache [2, blocks, block_size, kv_heads, head_dim], block_tables [seqs, width]),
    the last `window` of them only if given, scores soft-capped at `softcap` if given.
    Returns False, leaving `out` untouched, where the kernel cannot run (the caller falls back)."""
    library = _load()
    if library is None or not _supported(out, query, kv_cache):
        return False
    block_tables = block_tables.to(torch.int64)
    seq_lens = seq_lens.to(torch.int64).contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    strides = (ctypes.c_int64 * 9)(
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
    )  # fmt: skip
    fn = getattr(library, f"paged_attention_decode_{_NAMES[query.dtype]}")
    status = fn(
        out.data_ptr(), query.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, strides, scale, window or 0, softcap or 0.0,
        torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("paged_attention_decode: could not allocate its scratch")
    return True
