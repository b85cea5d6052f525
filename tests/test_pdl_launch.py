"""Programmatic dependent launch's host side without a GPU (zllm/workers/kernels/pdl.py, loader.launch):
ZLLM_PDL's parsing, which launches take the driver's path (only pdl=True ones, only with the switch
on and on sm_90+), the arguments packed as CuPy packs them, and the launch structures laid out as
cuda.h lays them out. tests/gpu/test_pdl_gpu.py runs the kernels both ways."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest
import torch

from zllm import envs
from zllm.workers.kernels import loader, pdl

# The argument tuples the wrappers pass: device pointers as uint64, sizes as int32, strides as
# int64, eps as float32 (zllm/workers/kernels/layernorm.py's rms_norm, say).
WRAPPER_ARGS = (
    np.uint64(0x7F00_1234_5670),
    np.uint64(0),
    np.float32(1e-6),
    np.int32(4096),
    np.int64(-3),
    np.int32(1),
)


@pytest.mark.parametrize(
    "raw,expected", [(None, True), ("", True), ("0", False), ("1", True), ("true", True), ("on", True)]
)
def test_the_switch_is_on_by_default(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("ZLLM_PDL", raising=False)
    else:
        monkeypatch.setenv("ZLLM_PDL", raw)
    assert envs.ZLLM_PDL is expected


@pytest.mark.parametrize(
    "switch,capability,expected",
    [("1", (9, 0), True), ("1", (10, 0), True), ("1", (8, 9), False), ("1", (8, 0), False), ("0", (9, 0), False)],
)
def test_active_needs_the_switch_and_sm90(monkeypatch, switch, capability, expected):
    monkeypatch.setenv("ZLLM_PDL", switch)
    monkeypatch.setattr(pdl, "_capabilities", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    assert pdl.active(0) is expected


class _FakeFunction:
    """A cupy.RawKernel (what RawModule.get_function gives): records the plain launches it is
    called for; .kernel is its cupy.cuda.Function on the current device, .kernel.ptr the CUfunction."""

    kernel = types.SimpleNamespace(ptr=0xDEAD_BEEF)

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.calls.append((grid, block, args, shared_mem))


def _fake_launch_environment(
    monkeypatch, capability: tuple[int, int], module_arch: int = 90
) -> tuple[_FakeFunction, list[tuple]]:
    """loader.launch with CuPy, the device and the driver replaced: returns the function (its plain
    launches) and the list of driver launches."""
    function, driver_launches = _FakeFunction(), []
    fake_cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0, free=lambda p: None))
    )
    monkeypatch.setattr(loader, "_cupy", lambda: fake_cupy)
    monkeypatch.setattr(loader, "get_function", lambda name, kernel, index: function)
    monkeypatch.setattr(loader, "module_arch", lambda name, index: module_arch)
    monkeypatch.setattr(loader, "_cupy_stream", lambda ptr, index: ("stream", ptr))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: types.SimpleNamespace(cuda_stream=0x5000))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(pdl, "_capabilities", {})
    monkeypatch.setattr(pdl, "has_current_context", lambda: True)
    monkeypatch.setattr(pdl, "launch", lambda *call: driver_launches.append(call))
    return function, driver_launches


@pytest.mark.parametrize(
    "switch,capability,marked,via_driver",
    [
        ("1", (9, 0), True, True),
        ("1", (9, 0), False, False),  # a kernel that does not wait never goes out with PDL
        ("0", (9, 0), True, False),
        ("1", (8, 0), True, False),
    ],
)
def test_launch_path(monkeypatch, switch, capability, marked, via_driver):
    monkeypatch.setenv("ZLLM_PDL", switch)
    function, driver_launches = _fake_launch_environment(monkeypatch, capability)
    loader.launch(
        "gemv_kernels", "gemv_bf16_s2_b6", torch.device("cuda", 0), (7,), (128,), WRAPPER_ARGS, 64, pdl=marked
    )
    if via_driver:
        assert driver_launches == [(function.kernel.ptr, (7,), (128,), WRAPPER_ARGS, 64, 0x5000)]
        assert function.calls == []
    else:
        assert driver_launches == []
        assert function.calls == [((7,), (128,), WRAPPER_ARGS, 64)]


@pytest.mark.parametrize("module_arch,via_driver", [(90, True), (100, True), (80, False), (0, False)])
def test_only_modules_built_for_sm90_launch_with_pdl(monkeypatch, module_arch, via_driver):
    """On an H100, a module of compute_80 PTX (JIT-compiled) or of an unknown architecture has no
    griddepcontrol.wait in it: it launches without the attribute."""
    monkeypatch.setenv("ZLLM_PDL", "1")
    function, driver_launches = _fake_launch_environment(monkeypatch, (9, 0), module_arch)
    loader.launch("gemv_kernels", "gemv_bf16_s2_b6", torch.device("cuda", 0), (7,), (128,), WRAPPER_ARGS, pdl=True)
    assert bool(driver_launches) is via_driver
    assert bool(function.calls) is not via_driver


def test_module_arch_from_the_build_folder(tmp_path):
    assert loader._path_arch(tmp_path / "sm_90" / "gemv_kernels.cubin") == 90
    assert loader._path_arch(tmp_path / "compute_80" / "gemv_kernels.ptx") == 80
    assert loader._path_arch(tmp_path / "other" / "gemv_kernels.cubin") == 0


def test_a_zero_grid_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        pdl.launch_config((0, 4), (128,), 0, 0, pdl._pdl_attribute())


def test_kernel_params_point_at_each_arguments_bytes():
    """Each pointer of kernelParams points at its argument's bytes, as CuPy passes them: a numpy
    scalar as itself, a Python int as int64, a float as float64, None as a null pointer."""
    args = (*WRAPPER_ARGS, 5, 0.25, None, True)
    pointers, buffers = pdl.kernel_params(args)
    expected = [a.tobytes() for a in WRAPPER_ARGS] + [
        np.int64(5).tobytes(),
        np.float64(0.25).tobytes(),
        bytes(8),
        np.bool_(True).tobytes(),
    ]
    assert len(buffers) == len(args)
    for pointer, data in zip(pointers, expected):
        assert ctypes.string_at(pointer, len(data)) == data


def test_param_bytes_refuses_what_cupy_would_not_pack():
    with pytest.raises(TypeError):
        pdl.param_bytes("a string")


def test_launch_structures_follow_cuda_h():
    """CUlaunchAttribute: 4-byte id, padding, a 64-byte union at offset 8; CUlaunchConfig: seven
    unsigned ints, then the stream, the attribute pointer and their count on 8-byte boundaries."""
    assert pdl.LaunchAttribute.value.offset == 8 and ctypes.sizeof(pdl.LaunchAttribute) == 72
    assert pdl.LaunchConfig.stream.offset == 32 and pdl.LaunchConfig.attrs.offset == 40
    assert pdl.LaunchConfig.num_attrs.offset == 48 and ctypes.sizeof(pdl.LaunchConfig) == 56
    attribute = pdl._pdl_attribute()
    assert attribute.id == pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert bytes(attribute)[8:12] == np.int32(1).tobytes()  # programmaticStreamSerializationAllowed
    config = pdl.launch_config((3, 2), (128,), 96, 0x5000, attribute)
    dims = (config.grid_dim_x, config.grid_dim_y, config.grid_dim_z, config.block_dim_x, config.block_dim_y)
    assert dims == (3, 2, 1, 128, 1) and config.block_dim_z == 1
    assert (config.shared_mem_bytes, config.stream, config.num_attrs) == (96, 0x5000, 1)
    assert ctypes.addressof(config.attrs.contents) == ctypes.addressof(attribute)
