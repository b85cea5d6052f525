"""Find, load and launch zllm's CUDA kernels (csrc/*.cu) through CuPy.

Per kernel file and device, the first that loads wins:
  1. a prebuilt cubin for the device's architecture (same major, highest minor not above it) or
     PTX for an older virtual architecture, from $ZLLM_CSRC_BUILD or <csrc>/build (the layout of
     scripts/build_csrc.sh: sm_90/attention_kernels.cubin, compute_90/attention_kernels.ptx),
     skipped when older than the sources;
  2. the .cu source compiled at run time by NVRTC (cupy.RawModule(code=...), cached on disk by
     CuPy), with the local headers inlined.
$ZLLM_KERNELS picks the path: "auto" (default), "prebuilt" (fail rather than compile) or "nvrtc".
The sources are found at $ZLLM_CSRC_DIR, a csrc/ folder packaged beside this module, or the
repository's csrc/ (a sibling of the zllm package).

CuPy is imported on first use only: importing this module needs neither CuPy nor a GPU.
Launches go to torch's current stream of the tensors' device, so they are ordered with torch's
own work and can be captured by torch.cuda.graph (load the modules eagerly first: `preload`).
A launch marked pdl=True may go out with programmatic dependent launch instead (kernels/pdl.py,
ZLLM_PDL).
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zllm import envs
from zllm.workers.kernels import pdl as pdl_launch

# Kernel file -> one of its entry points (used to force the module load on a device).
KERNEL_FILES: dict[str, str] = {
    "activation_kernels": "silu_and_mul_f32",
    "allreduce_kernels": "all_reduce_add_rms_norm_f32_w2",
    "attention_kernels": "paged_attention_reduce_f32_d64",
    "attention_window_kernels": "paged_attention_decode_f32_win_d64_g1",
    "cache_kernels": "reshape_and_cache_f32",
    "gemv_kernels": "gemv_f32",
    "layernorm_kernels": "rms_norm_f32",
    "mla_kernels": "mla_decode_f32_d576_v512",
    "lora_kernels": "lora_shrink_f32",
    "moe_kernels": "moe_align",
    "pos_encoding_kernels": "rotary_embedding_f32",
    "quant_kernels": "quant_fp8_rows_f32",
}
NVRTC_OPTIONS = ("-std=c++17",)
_MODES = ("auto", "prebuilt", "nvrtc")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)


class KernelUnavailableError(RuntimeError):
    """The CUDA kernels cannot run here: no CuPy, no CUDA device, or no loadable module."""


@dataclass(slots=True)
class LoadedModule:
    module: Any  # cupy.RawModule
    origin: str  # "prebuilt:<path>" or "nvrtc"
    # The architecture its code was compiled for (90: sm_90 / compute_90), 0 if unknown. A module
    # built below sm_90 has no griddepcontrol.wait in it (csrc/common.cuh), even on an H100.
    arch: int = 0


def _path_arch(path: Path) -> int:
    """90 for .../sm_90/x.cubin or .../compute_90/x.ptx; 0 for a folder of another name."""
    digits = path.parent.name.removeprefix("sm_").removeprefix("compute_")
    return int(digits) if digits.isdigit() else 0


def _nvrtc_arch(cupy: Any) -> int:
    """The architecture CuPy's NVRTC compiles for on the current device (its private helper; 0,
    and so no PDL for NVRTC-built kernels, where a CuPy release no longer has it)."""
    try:
        return int(cupy.cuda.compiler._get_arch())
    except Exception:  # noqa: BLE001 - any CuPy without the helper
        return 0


_lock = threading.Lock()
_modules: dict[tuple[int, str], LoadedModule] = {}
_functions: dict[tuple[int, str], Any] = {}
_streams: dict[int, Any] = {}
_shared_opt_in: dict[tuple[int, str], int] = {}
_resident: dict[tuple[int, str, int, int], int] = {}  # resident_blocks: blocks an SM runs
_cupy_module: Any = None


def cupy_available() -> bool:
    try:
        _cupy()
    except KernelUnavailableError:
        return False
    return True


def _cupy() -> Any:
    global _cupy_module
    if _cupy_module is None:
        try:
            import cupy
        except Exception as exc:  # ImportError, or a CuPy that finds no CUDA libraries
            raise KernelUnavailableError(f"zllm kernels need CuPy (cupy-cuda13x): {exc}") from exc
        _cupy_module = cupy
    return _cupy_module


# ---- where the sources and builds are ------------------------------------------------------------


def csrc_dir() -> Path:
    """The folder holding the kernel sources."""
    candidates = []
    if envs.ZLLM_CSRC_DIR:
        candidates.append(Path(envs.ZLLM_CSRC_DIR))
    here = Path(__file__).resolve().parent
    candidates += [here / "csrc", here.parents[2] / "csrc"]
    for candidate in candidates:
        if (candidate / "attention_kernels.cu").is_file():
            return candidate
    raise KernelUnavailableError(
        "zllm kernels: no CUDA sources found (looked in " + ", ".join(map(str, candidates)) + "); set ZLLM_CSRC_DIR"
    )


def build_dirs() -> list[Path]:
    """Folders that may hold prebuilt cubins / PTX, in order of preference."""
    dirs = []
    if envs.ZLLM_CSRC_BUILD:
        dirs.append(Path(envs.ZLLM_CSRC_BUILD))
    try:
        dirs.append(csrc_dir() / "build")
    except KernelUnavailableError:
        pass
    return [d for d in dirs if d.is_dir()]


def kernel_source(name: str) -> str:
    """The text NVRTC compiles: <name>.cu with its local "..." includes inlined."""
    root = csrc_dir()
    return _inline(root, f"{name}.cu", set())


def _inline(root: Path, filename: str, seen: set[str]) -> str:
    text = _PRAGMA_ONCE.sub("", (root / filename).read_text())
    pieces, last = [], 0
    for match in _INCLUDE.finditer(text):
        header = match.group(1)
        pieces.append(text[last : match.start()])
        if header not in seen:
            seen.add(header)
            line_after = text.count("\n", 0, match.end()) + 2
            pieces.append(f'#line 1 "{header}"\n{_inline(root, header, seen)}\n#line {line_after} "{filename}"')
        last = match.end()
    pieces.append(text[last:])
    return "".join(pieces)


def _sources_mtime() -> float:
    root = csrc_dir()
    return max(p.stat().st_mtime for pattern in ("*.cu", "*.cuh") for p in root.glob(pattern))


def prebuilt_candidates(name: str, capability: tuple[int, int]) -> list[Path]:
    """Prebuilt modules that can run on a device of this compute capability, best first."""
    major, minor = capability
    found = []
    for build in build_dirs():
        for m in range(minor, -1, -1):  # a cubin runs on its major version at an equal or higher minor
            found.append(build / f"sm_{major}{m}" / f"{name}.cubin")
        ptx = []
        for folder in build.glob("compute_*"):
            arch = folder.name.removeprefix("compute_")
            if arch.isdigit() and int(arch) <= major * 10 + minor:
                ptx.append((int(arch), folder / f"{name}.ptx"))
        found += [path for _, path in sorted(ptx, reverse=True)]
    return [p for p in found if p.is_file()]


# ---- loading -----------------------------------------------------------------------------------------


def _mode() -> str:
    mode = envs.ZLLM_KERNELS
    if mode not in _MODES:
        raise KernelUnavailableError(f"ZLLM_KERNELS={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def load_module(name: str, device_index: int) -> LoadedModule:
    """The module of kernel file `name` on a device, loaded (or compiled) on first use."""
    if name not in KERNEL_FILES:
        raise KeyError(f"unknown kernel file {name!r}")
    key = (device_index, name)
    with _lock:
        loaded = _modules.get(key)
        if loaded is None:
            loaded = _modules[key] = _load(name, device_index, _mode())
        return loaded


def reset() -> None:
    """Forget loaded modules and functions (the next launch loads again, e.g. after changing
    $ZLLM_KERNELS)."""
    with _lock:
        _modules.clear()
        _functions.clear()
        _shared_opt_in.clear()
        _resident.clear()


def _load(name: str, device_index: int, mode: str) -> LoadedModule:
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        if mode != "nvrtc":
            loaded = _load_prebuilt(cupy, name, torch.cuda.get_device_capability(device_index))
            if loaded is not None:
                return loaded
            if mode == "prebuilt":
                raise KernelUnavailableError(
                    f"zllm kernels: no usable prebuilt {name} for compute capability "
                    f"{torch.cuda.get_device_capability(device_index)} in {build_dirs()}; run scripts/build_csrc.sh"
                )
        return _compile(cupy, name)


def _load_prebuilt(cupy: Any, name: str, capability: tuple[int, int]) -> LoadedModule | None:
    newest_source = _sources_mtime()
    for path in prebuilt_candidates(name, capability):
        if path.stat().st_mtime < newest_source:
            warnings.warn(f"zllm kernels: {path} is older than the sources in {csrc_dir()}; not using it", stacklevel=4)
            continue
        try:
            module = cupy.RawModule(path=str(path))
            module.get_function(KERNEL_FILES[name])  # loads the module on the current device
        except Exception as exc:  # e.g. a driver too old for this toolkit's cubins
            warnings.warn(f"zllm kernels: cannot load {path}: {exc}", stacklevel=4)
            continue
        return LoadedModule(module, f"prebuilt:{path}", _path_arch(path))
    return None


def _compile(cupy: Any, name: str) -> LoadedModule:
    source = kernel_source(name)
    options = NVRTC_OPTIONS
    try:
        module = cupy.RawModule(code=source, options=options)
        module.get_function(KERNEL_FILES[name])  # compiles now, not at the first launch
    except cupy.cuda.compiler.CompileException as exc:
        include = _toolkit_include()
        if include is None or "cuda_" not in str(exc):
            raise
        # NVRTC found no cuda_fp16.h / cuda_bf16.h on CuPy's include path: try the toolkit's.
        module = cupy.RawModule(code=source, options=options + (f"-I{include}",))
        module.get_function(KERNEL_FILES[name])
    return LoadedModule(module, "nvrtc", _nvrtc_arch(cupy))


def _toolkit_include() -> str | None:
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_bf16.h").is_file():
            return str(Path(root) / "include")
    return None


def module_arch(name: str, device_index: int) -> int:
    """The architecture kernel file `name`'s module on this device was compiled for."""
    return load_module(name, device_index).arch


def get_function(name: str, kernel: str, device_index: int) -> Any:
    key = (device_index, kernel)
    function = _functions.get(key)
    if function is None:
        module = load_module(name, device_index)
        with _cupy().cuda.Device(device_index):
            function = module.module.get_function(kernel)
        _functions[key] = function
    return function


def allow_shared_memory(name: str, kernel: str, device: torch.device | int | None, nbytes: int) -> None:
    """Let `kernel` of kernel file `name` launch with nbytes of dynamic shared memory on `device`.

    Past 48 KiB a kernel must opt in (cudaFuncAttributeMaxDynamicSharedMemorySize); the carveout
    is set to all-shared too, so that several such blocks fit an SM. Once per device and kernel:
    not a stream operation, so a CUDA-graph capture may run it."""
    index = _device_index(device)
    key = (index, kernel)
    if _shared_opt_in.get(key, 0) >= nbytes:
        return
    function = get_function(name, kernel, index)
    with _cupy().cuda.Device(index):
        function.max_dynamic_shared_size_bytes = nbytes
        function.preferred_shared_memory_carveout = 100  # percent: shared memory over L1
    _shared_opt_in[key] = nbytes


def resident_blocks(name: str, kernel: str, device: torch.device | int | None, threads: int, shared: int) -> int:
    """How many blocks of `threads` threads and `shared` bytes of dynamic shared memory one SM
    runs at once (the driver's occupancy calculator, registers and static shared memory
    included); past 48 KiB, after allow_shared_memory. Not a stream operation: capture-safe."""
    index = _device_index(device)
    key = (index, kernel, threads, shared)
    count = _resident.get(key)
    if count is None:
        function = get_function(name, kernel, index)
        cupy = _cupy()
        with cupy.cuda.Device(index):
            count = int(
                cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.kernel.ptr, threads, shared)
            )
        _resident[key] = count
    return count


def preload(device: torch.device | int | None = None) -> dict[str, str]:
    """Load (or compile) every kernel file on a device now; returns file -> origin.

    Call it before capturing CUDA graphs so that no module is loaded during a capture."""
    index = _device_index(device)
    return {name: load_module(name, index).origin for name in KERNEL_FILES}


# ---- launching -----------------------------------------------------------------------------------


class _TorchStream:
    """A raw stream handle in the CUDA stream protocol (what cupy.cuda.Stream.from_external takes)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _cupy_stream(ptr: int, device_index: int) -> Any:
    stream = _streams.get(ptr)
    if stream is None:
        cupy = _cupy()
        if hasattr(cupy.cuda.Stream, "from_external"):
            stream = cupy.cuda.Stream.from_external(_TorchStream(ptr))
        else:  # CuPy < 14
            stream = cupy.cuda.ExternalStream(ptr, device_index)
        if len(_streams) > 256:
            _streams.clear()
        _streams[ptr] = stream
    return stream


def _device_index(device: torch.device | int | None) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def launch(
    name: str,
    kernel: str,
    device: torch.device,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
    shared_mem: int = 0,
    pdl: bool = False,
) -> None:
    """Launch `kernel` of kernel file `name` on torch's current stream of `device`.

    pdl: the kernel waits for the one before it (csrc/common.cuh pdl_wait) before it reads that
    kernel's output or writes anything, so it may go out with programmatic dependent launch,
    which it does where pdl.active (ZLLM_PDL on an sm_90+ device) and the module was built for
    sm_90+; otherwise CuPy launches it."""
    index = _device_index(device)
    cupy = _cupy()
    function = get_function(name, kernel, index)
    stream_ptr = torch.cuda.current_stream(index).cuda_stream
    # Only code built for sm_90+ waits: a module of older PTX (JIT-compiled here) launched with
    # the attribute would read its predecessor's output before that kernel finished.
    with_pdl = pdl and pdl_launch.active(index) and module_arch(name, index) >= pdl_launch.PDL_MIN_ARCH
    if cupy.cuda.runtime.getDevice() == index:
        _launch_here(cupy, function, grid, block, args, shared_mem, stream_ptr, index, with_pdl)
    else:
        with cupy.cuda.Device(index):
            _launch_here(cupy, function, grid, block, args, shared_mem, stream_ptr, index, with_pdl)


def _launch_here(
    cupy: Any,
    function: Any,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
    shared_mem: int,
    stream_ptr: int,
    index: int,
    with_pdl: bool,
) -> None:
    """One launch on the current device: CuPy's, or the driver's with the PDL attribute."""
    if not with_pdl:
        function(grid, block, args, shared_mem=shared_mem, stream=_cupy_stream(stream_ptr, index))
        return
    if not pdl_launch.has_current_context():
        cupy.cuda.runtime.free(0)  # a thread that never ran CUDA work: cudaFree(0) makes the context current
    # A RawModule's function is a cupy.RawKernel: .kernel is its Function on the current device,
    # whose .ptr is the CUfunction.
    pdl_launch.launch(function.kernel.ptr, grid, block, args, shared_mem, stream_ptr)
