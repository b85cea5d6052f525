"""Programmatic dependent launch (PDL, sm_90+): a kernel launched through the driver's
cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start while the
kernel before it in the stream drains; under stream capture the launch becomes a programmatic edge
of the CUDA graph (CUDA 12.3+). Only kernels that wait for their predecessor before reading its
output or writing anything (csrc/common.cuh pdl_wait) may go out this way: loader.launch(...,
pdl=True) says so for a launch, and `active` says whether ZLLM_PDL lets it on this device.

CuPy's launch takes no attributes, so the driver is called through ctypes on libcuda.so.1 with the
CUfunction of CuPy's kernel (`RawKernel.kernel.ptr`) and the arguments packed as CuPy packs them
(each numpy scalar's own bytes): the kernel sees the same parameters either way."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import torch

from zllm import envs

# cuda.h: CUlaunchAttributeID
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
PDL_MIN_MAJOR = 9  # compute capability 9.0 (Hopper) and newer have griddepcontrol
PDL_MIN_ARCH = PDL_MIN_MAJOR * 10  # a module compiled for sm_90 / compute_90 or newer waits


class _AttributeValue(ctypes.Union):
    """cuda.h's CUlaunchAttributeValue: 64 bytes, aligned as its pointer members."""

    _fields_ = [
        ("pad", ctypes.c_char * 64),
        ("programmatic_stream_serialization_allowed", ctypes.c_int),
        ("_pointer_alignment", ctypes.c_void_p),
    ]


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: the id, padding to 8 bytes, the value."""

    _fields_ = [("id", ctypes.c_uint), ("value", _AttributeValue)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [
        ("grid_dim_x", ctypes.c_uint),
        ("grid_dim_y", ctypes.c_uint),
        ("grid_dim_z", ctypes.c_uint),
        ("block_dim_x", ctypes.c_uint),
        ("block_dim_y", ctypes.c_uint),
        ("block_dim_z", ctypes.c_uint),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


def supported(capability: tuple[int, int]) -> bool:
    """Whether a device of this compute capability has programmatic dependent launch."""
    return capability[0] >= PDL_MIN_MAJOR


_capabilities: dict[int, tuple[int, int]] = {}


def active(device_index: int) -> bool:
    """Whether launches marked pdl=True go out with PDL on this device: ZLLM_PDL on and sm_90+."""
    if not envs.ZLLM_PDL:
        return False
    capability = _capabilities.get(device_index)
    if capability is None:
        capability = _capabilities[device_index] = torch.cuda.get_device_capability(device_index)
    return supported(capability)


def param_bytes(arg: Any) -> bytes:
    """One kernel argument's bytes as CuPy's launch packs it: a numpy scalar's own bytes, a Python
    int as int64, a float as float64, a bool as one byte, None as a null pointer."""
    if arg is None:
        return bytes(8)
    if isinstance(arg, np.generic):
        return arg.tobytes()
    if isinstance(arg, bool):
        return np.bool_(arg).tobytes()
    if isinstance(arg, int):
        return np.int64(arg).tobytes()
    if isinstance(arg, float):
        return np.float64(arg).tobytes()
    raise TypeError(f"kernel argument of type {type(arg).__name__}: expected a numpy scalar, int, float, bool or None")


def kernel_params(args: tuple[Any, ...]) -> tuple[ctypes.Array, list[ctypes.Array]]:
    """cuLaunchKernelEx's kernelParams (an array of pointers, one to each argument's bytes) and the
    buffers they point into, which must outlive the call."""
    buffers = [ctypes.create_string_buffer(data, len(data)) for data in map(param_bytes, args)]
    pointers = (ctypes.c_void_p * max(1, len(buffers)))(*(ctypes.addressof(b) for b in buffers))
    return pointers, buffers


def launch_config(
    grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int, stream: int, attribute: LaunchAttribute
) -> LaunchConfig:
    """The launch's CUlaunchConfig with one attribute; missing dimensions are 1 (as CuPy fills them)."""
    if any(d < 1 for d in grid):
        raise ValueError(f"grid {tuple(grid)}: every dimension must be at least 1")
    gx, gy, gz = (max(1, d) for d in (tuple(grid) + (1, 1))[:3])
    bx, by, bz = (max(1, d) for d in (tuple(block) + (1, 1))[:3])
    return LaunchConfig(gx, gy, gz, bx, by, bz, shared_mem, stream, ctypes.pointer(attribute), 1)


def _pdl_attribute() -> LaunchAttribute:
    attribute = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value.programmatic_stream_serialization_allowed = 1
    return attribute


class _Driver:
    """The three driver entry points the launch needs, from libcuda.so.1."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.launch_kernel_ex = lib.cuLaunchKernelEx
        self.launch_kernel_ex.argtypes = [
            ctypes.POINTER(LaunchConfig),
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p),
        ]
        self.launch_kernel_ex.restype = ctypes.c_int
        self.ctx_get_current = lib.cuCtxGetCurrent
        self.ctx_get_current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.ctx_get_current.restype = ctypes.c_int
        self.get_error_name = lib.cuGetErrorName
        self.get_error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.get_error_name.restype = ctypes.c_int

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        self.get_error_name(code, ctypes.byref(name))
        return name.value.decode() if name.value else f"CUresult {code}"


_driver_lock = threading.Lock()
_driver: _Driver | None = None
_ATTRIBUTE = _pdl_attribute()


def _get_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def has_current_context() -> bool:
    """Whether this thread has a current CUDA context (cuLaunchKernelEx launches into it)."""
    context = ctypes.c_void_p()
    return _get_driver().ctx_get_current(ctypes.byref(context)) == 0 and bool(context.value)


def launch(
    function_ptr: int,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
    shared_mem: int,
    stream: int,
) -> None:
    """Launch the CUfunction `function_ptr` on `stream` with programmatic stream serialization
    allowed; the caller has made the function's context current."""
    driver = _get_driver()
    config = launch_config(grid, block, shared_mem, stream, _ATTRIBUTE)
    params, _buffers = kernel_params(args)
    result = driver.launch_kernel_ex(ctypes.byref(config), function_ptr, params, None)
    if result != 0:
        raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch): {driver.error_name(result)}")
