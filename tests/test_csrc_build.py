"""The CUDA kernels build without a GPU (scripts/build_csrc.sh, every entry point that
zllm.workers.kernels launches), and the loader finds them and stays importable without CuPy.

The build here makes sm_80 cubins and compute_90 PTX, not build_csrc.sh's default sm_89 and
sm_90 cubins too: those two compile each side of every __CUDA_ARCH__ branch in csrc (< 890 in
the cubins, >= 890 and >= 900 in the PTX): on a 2-core machine 340 s alone and 382 s in a whole
CI run, against the default build's 415 s in a whole CI run; the GPU sessions build and run the
sm_90 cubins themselves (benchmarks/gpu/)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from zllm.workers import kernels
from zllm.workers.kernels import loader, matvec

ROOT = Path(__file__).resolve().parents[1]
CUBIN_ARCHS = (80,)  # the lowest real architecture the default build makes
PTX_ARCH = 90
needs_nvcc = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("cmake") is None, reason="needs nvcc and cmake"
)


def expected_entry_points() -> dict[str, set[str]]:
    """Kernel file -> the names the wrappers in zllm/workers/kernels/ launch."""
    names: dict[str, set[str]] = {name: set() for name in loader.KERNEL_FILES}
    for dt in ("f32", "f16", "bf16"):
        for vec in ("", "_vec"):
            names["cache_kernels"].add(f"reshape_and_cache_{dt}{vec}")
            names["layernorm_kernels"] |= {f"rms_norm_{dt}{vec}", f"fused_add_rms_norm_{dt}{vec}"}
            names["activation_kernels"] |= {f"silu_and_mul_{dt}{vec}", f"gelu_tanh_and_mul_{dt}{vec}"}
        for lora in ("", "lora_"):  # and the builds with LoRA's expand in the epilogue
            names["gemv_kernels"].add(f"gemv_{lora}{dt}")
            names["gemv_kernels"] |= {f"gemv_{lora}{dt}_s{s}_b{b}" for s in (1, 2, 4) for b in (0, 4, 6)}
            names["gemv_kernels"] |= gemv_rows_entry_points(dt, lora)
        names["gemv_kernels"] |= {f"gemv_fp8_{dt}", f"gemv_fp8_{dt}_block"}
        # The pairs of rows with an epilogue (matvec.gemv_act_and_mul, gemv_rope_cache and their FP8 forms).
        epilogues = ("silu_and_mul", "gelu_tanh_and_mul", "rope_cache", "rope_cache_kvfp8")
        names["gemv_kernels"] |= {f"gemv_fp8_{dt}_{epi}" for epi in epilogues}
        names["gemv_kernels"] |= {f"gemv_{dt}_s{s}_b6_{epi}" for s in (1, 2, 4) for epi in epilogues}
        names["pos_encoding_kernels"] |= {f"rotary_embedding_{dt}", f"rotary_embedding_and_cache_{dt}"}
        names["moe_kernels"].add(f"moe_topk_softmax_{dt}")
        names["mla_kernels"] |= {f"mla_decode_{dt}_d576_v512"}
        names["mla_kernels"] |= {f"paged_attention_decode_sinks_{dt}_d{d}" for d in (64, 128)}
        names["lora_kernels"] |= {f"lora_shrink_{dt}", f"lora_expand_{dt}"}
        names["layernorm_kernels"].add(f"fused_add_rms_norm_lora_shrink_{dt}")  # with the next LoRA shrink
        names["activation_kernels"] |= {f"silu_and_mul_lora_shrink_{dt}", f"gelu_tanh_and_mul_lora_shrink_{dt}"}
        if dt != "f32":  # rope + cache with 16-byte accesses (ZLLM_ROPE_VEC): 16-bit heads only
            names["pos_encoding_kernels"] |= {f"rotary_embedding_and_cache_vec_{dt}{c}" for c in ("", "_kvfp8")}
        if dt != "f32":  # the grouped GEMMs run on tensor cores: half precision only
            names["moe_kernels"] |= {f"moe_{part}_{dt}_m{m}" for part in ("gate_up", "down") for m in (1, 2, 4)}
            names["moe_kernels"].add(f"moe_sum_{dt}")
            names["moe_kernels"] |= {
                f"moe_gemv_{part}_{dt}_s{s}_b{b}" for part in ("gate_up", "down") for s, b in ((1, 4), (1, 0), (4, 4))
            }
        for d in (64, 96, 128, 256):
            names["attention_kernels"].add(f"paged_attention_reduce_{dt}_d{d}")
            for cache in ("", "_kvfp8"):
                names["attention_kernels"] |= {f"paged_attention_decode_{dt}{cache}_d{d}_g{g}" for g in (1, 4, 8)}
                if dt != "f32" and d in (64, 128):  # the pipelined build (csrc/attention_pipe.cuh)
                    names["attention_kernels"] |= {
                        f"paged_attention_decode_pipe_{dt}{cache}_d{d}_g{g}_s{s}" for g in (1, 4, 8) for s in (2, 3)
                    }
                    names["attention_kernels"] |= {  # each block loops over partitions
                        f"paged_attention_decode_pipe_{dt}{cache}_d{d}_g{g}_s2_loop" for g in (1, 4, 8)
                    }
                names["attention_window_kernels"] |= {  # sliding window, soft-capped
                    f"paged_attention_decode_{dt}{cache}{family}_d{d}_g{g}"
                    for family in ("_win", "_cap")
                    for g in (1, 4, 8)
                }
    names["moe_kernels"].add("moe_align")
    names["gemv_kernels"] |= fp8_gemv_bf16_entry_points()
    for dt in ("f32", "bf16"):  # the symmetric buffer's dtypes, a build per world size
        for world in (2, 4, 8):
            names["allreduce_kernels"] |= {
                f"all_reduce_add_rms_norm_{dt}_w{world}",
                f"lamport_all_reduce_add_rms_norm_{dt}_w{world}",
                f"lamport_all_reduce_{dt}_w{world}",
            }
    return names


def fp8_gemv_bf16_entry_points() -> set[str]:
    """The FP8 GEMV's other builds (bf16, per-row scales): the rows-per-warp shapes and issue 40's
    split and tensor-core builds (csrc/gemv_kernels.cu)."""
    names = {f"gemv_fp8_bf16{v}" for v in matvec._FP8_GEMV_SHAPES if v}
    names |= {f"gemv_fp8_bf16_split_s{s}" for s in (1, 2, 4)}
    for shape in ("g1u4", "g2u2", "g1u4x", "g2u2x", "g1u8x", "g2u4x"):
        names |= {f"gemv_fp8_bf16_mma_{shape}_s{s}" for s in (1, 2, 4)}
    return names


def gemv_rows_entry_points(dt: str, lora: str = "") -> set[str]:
    """Every build of the 2-8-row GEMV (csrc/gemv_kernels.cu) of one dtype (lora="lora_": with
    LoRA's expand in the epilogue)."""
    names = {f"gemv_rows_{lora}{dt}_fma_t{t}_s{s}" for t in (2, 4, 8) for s in (1, 2, 4)}
    if dt != "f32":  # tensor cores: half precision only
        names |= {f"gemv_rows_{lora}{dt}_mma_g{g}_s{s}" for g in (1, 2) for s in (1, 2, 4)}
    return names


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("csrc_build")
    result = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "build_csrc.sh"),
            str(out),
            "-DZLLM_CUBIN_ARCHS=" + ";".join(map(str, CUBIN_ARCHS)),
        ],
        capture_output=True,
        text=True,
        # A bound, not a speed check: this build took 382 s in a whole CI run once, and 954 s in
        # one on 2026-11-29 (6.7 min of ptxas for attention_window_kernels' sm_80 cubin alone).
        timeout=1800,
        cwd=ROOT,
    )
    assert result.returncode == 0, f"build failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
    return out


@needs_nvcc
def test_build_makes_cubins_and_ptx(build_dir):
    for name, entries in expected_entry_points().items():
        for arch in CUBIN_ARCHS:
            cubin = build_dir / f"sm_{arch}" / f"{name}.cubin"
            assert cubin.is_file() and cubin.stat().st_size > 0, cubin
            assert cubin.read_bytes()[:4] == b"\x7fELF"
        ptx = (build_dir / f"compute_{PTX_ARCH}" / f"{name}.ptx").read_text()
        assert re.search(rf"^\.target sm_{PTX_ARCH}\b", ptx, re.MULTILINE)
        found = set(re.findall(r"^\.visible \.entry (\w+)\(", ptx, re.MULTILINE))
        assert entries <= found, f"{name}: missing {sorted(entries - found)}"


def test_loader_picks_the_build_for_each_gpu(tmp_path, monkeypatch):
    """Over the default build's layout (sm_80/89/90 cubins, compute_90 PTX; empty files: the choice
    reads names only)."""
    build_dir = tmp_path / "build"
    for folder, suffix in [("sm_80", "cubin"), ("sm_89", "cubin"), ("sm_90", "cubin"), ("compute_90", "ptx")]:
        (build_dir / folder).mkdir(parents=True)
        (build_dir / folder / f"attention_kernels.{suffix}").touch()
    monkeypatch.setenv("ZLLM_CSRC_BUILD", str(build_dir))
    first = {cc: loader.prebuilt_candidates("attention_kernels", cc)[:1] for cc in [(9, 0), (8, 9), (8, 6), (12, 0)]}
    assert first[(9, 0)] == [build_dir / "sm_90" / "attention_kernels.cubin"]
    assert first[(8, 9)] == [build_dir / "sm_89" / "attention_kernels.cubin"]
    assert first[(8, 6)] == [build_dir / "sm_80" / "attention_kernels.cubin"]  # same major, lower minor
    assert first[(12, 0)] == [build_dir / "compute_90" / "attention_kernels.ptx"]  # JIT by the driver
    assert loader.prebuilt_candidates("attention_kernels", (7, 5)) == []


def test_nvrtc_source_inlines_the_headers():
    source = loader.kernel_source("attention_kernels")
    assert '#include "' not in source and "#pragma once" not in source
    assert "struct Cvt<__nv_bfloat16>" in source  # common.cuh, inlined
    assert '#line 1 "common.cuh"' in source and '#line 1 "fp8.cuh"' in source
    assert source.count('#line 1 "common.cuh"') == 1  # included by the file and by fp8.cuh: inlined once
    includes = set(re.findall(r"#include <([^>]+)>", source))
    # All NVRTC needs beyond its built-ins (cuda_fp8.h for the FP8 KV cache's E4M3 conversions).
    assert includes == {"cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h"}


def test_ops_reject_cpu_tensors_without_touching_cupy():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="CUDA tensor"):
        kernels.rms_norm(torch.empty_like(x), x, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="CUDA tensor"):
        kernels.silu_and_mul(torch.empty(2, 4), x)


def test_gemv_rows_rejects_cpu_tensors_without_touching_cupy():
    x, weight = torch.randn(4, 64), torch.randn(32, 64)
    assert not kernels.gemv_rows_supported(x, weight)
    with pytest.raises(ValueError, match="gemv_rows: out is on cpu; expected a CUDA tensor"):
        kernels.gemv_rows(torch.empty(4, 32), x, weight)


def test_gemv_rows_launches_only_builds_that_exist():
    """Every name gemv_rows_kernel can give is an entry point the build test checks, for every row
    count, shape class and variant, and a block's rows are what the kernel covers."""
    built = set().union(*(gemv_rows_entry_points(dt) for dt in ("f32", "f16", "bf16")))
    built_lora = set().union(*(gemv_rows_entry_points(dt, "lora_") for dt in ("f32", "f16", "bf16")))
    variants = ["", "mma", "fma"] + [f"mma_g{g}_s{s}" for g in (1, 2) for s in (1, 2, 4)]
    variants += [f"fma_s{s}" for s in (1, 2, 4)] + [f"mma_s{s}" for s in (1, 2, 4)]
    for dt in ("f32", "f16", "bf16"):
        for m in range(1, 9):
            for n, k in [(7, 64), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
                for variant in variants:
                    if dt == "f32" and variant.startswith("mma"):
                        continue
                    name, rows = matvec.gemv_rows_kernel(dt, m, n, k, variant)
                    assert name in built, (dt, m, n, k, variant, name)
                    assert name.replace("gemv_rows_", "gemv_rows_lora_", 1) in built_lora  # gemv_rows(lora=)
                    split = int(name.rsplit("_s", 1)[1])
                    if "_mma_" in name:
                        groups = int(name.split("_g")[1].split("_")[0])
                        assert rows == 8 * groups * 4 // split
                    else:
                        assert rows == 4 // split and int(name.split("_t")[1].split("_")[0]) >= m


def test_gemv_rows_default_builds():
    """fp16/bf16 take the tensor-core build, one group of 8 rows a warp, split until a launch has
    2048 warps; fp32 the CUDA-core build with the one-row kernel's split and the fewest
    accumulators that hold m rows."""
    assert matvec.gemv_rows_kernel("bf16", 5, 4096, 4096) == ("gemv_rows_bf16_mma_g1_s4", 8)  # o: 512 tiles
    assert matvec.gemv_rows_kernel("bf16", 8, 6144, 4096) == ("gemv_rows_bf16_mma_g1_s4", 8)  # qkv: 768
    assert matvec.gemv_rows_kernel("f16", 2, 28672, 4096) == ("gemv_rows_f16_mma_g1_s1", 32)  # gate_up: 3584
    assert matvec.gemv_rows_kernel("bf16", 8, 128256, 4096) == ("gemv_rows_bf16_mma_g1_s1", 32)
    assert matvec.gemv_rows_kernel("bf16", 8, 512, 4096) == ("gemv_rows_bf16_mma_g1_s4", 8)  # too few tiles
    assert matvec.gemv_rows_kernel("f32", 3, 4096, 4096) == (
        f"gemv_rows_f32_fma_t4_s{matvec.gemv_split(1024)}",
        4 // matvec.gemv_split(1024),
    )
    assert matvec.gemv_rows_kernel("f32", 5, 4096, 64)[0] == "gemv_rows_f32_fma_t8_s1"
    assert matvec.gemv_rows_kernel("bf16", 2, 4096, 4096, "fma")[0] == "gemv_rows_bf16_fma_t2_s2"


@pytest.mark.parametrize(
    "dt, m, variant",
    [
        ("f32", 2, "mma"),
        ("bf16", 2, "mma_g3_s4"),
        ("bf16", 2, "mma_g1_s8"),
        ("bf16", 2, "fma_g1_s2"),
        ("bf16", 2, "dot"),
        ("bf16", 2, "mma_s4_g1"),
        ("bf16", 9, ""),
        ("bf16", 0, ""),
    ],
)
def test_gemv_rows_rejects_what_is_not_built(dt, m, variant):
    with pytest.raises(ValueError, match="gemv_rows"):
        matvec.gemv_rows_kernel(dt, m, 4096, 4096, variant)


def test_fp8_gemv_launches_only_builds_that_exist():
    """Every name fp8_gemv_kernel gives, for every variant and shape class, is an entry point the
    build test checks; a block's rows are what the kernel covers, and the staged builds get x's
    f16 copy as dynamic shared memory (none past FP8_GEMV_STAGED_MAX_K)."""
    built = fp8_gemv_bf16_entry_points()
    for variant in matvec.fp8_gemv_variants()[1:]:  # "" is the per-dtype default, launched by name
        for n, k in [(3, 272), (1030, 576), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 28672)]:
            name, rows, shared = matvec.fp8_gemv_kernel(variant, n, k)
            assert name in built, (variant, n, k, name)
            if "_mma_" in name:
                split = int(name.rsplit("_s", 1)[1])
                assert rows == 16 * int(name.split("_g")[1][0]) * 4 // split
                assert shared == (2 * k if name.split("_s")[0].endswith("x") else 0)
                assert shared <= 2 * matvec.FP8_GEMV_STAGED_MAX_K
            elif "_split_" in name:
                assert rows == 4 // int(name.rsplit("_s", 1)[1]) and shared == 0
            else:
                assert rows == 4 * matvec._FP8_GEMV_SHAPES[variant][0] and shared == 0


def test_fp8_gemv_default_splits():
    """Llama-3-8B's projections: the tensor-core builds split until a launch has 2048 warps, the
    split build as gemv_split (each warp one round of 4 loads); past FP8_GEMV_STAGED_MAX_K the staged
    builds give way to the unstaged ones of the same tiles."""
    kernel = matvec.fp8_gemv_kernel
    assert kernel("_mma_g1u4x", 28672, 4096) == ("gemv_fp8_bf16_mma_g1u4x_s2", 32, 8192)  # gate_up: 1792 tiles
    assert kernel("_mma_g2u2x", 28672, 4096) == ("gemv_fp8_bf16_mma_g2u2x_s4", 32, 8192)  # 896 tiles
    assert kernel("_mma_g1u4x", 4096, 14336) == ("gemv_fp8_bf16_mma_g1u4x_s4", 16, 28672)  # down
    assert kernel("_mma_g1u4x", 57344, 8192)[0] == "gemv_fp8_bf16_mma_g1u4x_s1"  # 70B gate_up: 3584 tiles
    assert kernel("_mma_g2u4x", 8192, 28672) == ("gemv_fp8_bf16_mma_g2u2_s4", 32, 0)  # 70B down
    assert kernel("_mma_g1u8x_s2", 8192, 28672) == ("gemv_fp8_bf16_mma_g1u4_s2", 32, 0)
    assert kernel("_split", 28672, 4096) == ("gemv_fp8_bf16_split_s2", 2, 0)  # 256 units: 2 x 128
    assert kernel("_split", 4096, 14336) == ("gemv_fp8_bf16_split_s4", 1, 0)
    assert kernel("_split", 960, 576) == ("gemv_fp8_bf16_split_s1", 4, 0)
    assert kernel("_r2u2", 4096, 4096) == ("gemv_fp8_bf16_r2u2", 8, 0)


@pytest.mark.parametrize("variant", ["_mma", "_mma_g3u4x", "_mma_g1u4x_s8", "_split_s3", "_s2", "_split_s", "r1u4"])
def test_fp8_gemv_rejects_what_is_not_built(variant):
    with pytest.raises(ValueError, match="fp8_gemv: variant"):
        matvec.fp8_gemv_kernel(variant, 4096, 4096)


def test_fp8_gemv_wide_picks_the_build_by_output_rows(monkeypatch):
    """ZLLM_FP8_GEMV_WIDE="MIN_N:VARIANT": layers of at least MIN_N output rows run VARIANT, the
    others ZLLM_FP8_GEMV's build; a malformed value is refused with the expected form."""
    assert matvec.parse_fp8_gemv_wide("") is None
    assert matvec.parse_fp8_gemv_wide("16384:_split") == (16384, "_split")
    assert matvec.parse_fp8_gemv_wide("16384:") == (16384, "")
    for bad in ("_split", "x:_split", "0:_split", "16384:_nope"):
        with pytest.raises(ValueError, match="MIN_N:VARIANT|is not one of"):
            matvec.parse_fp8_gemv_wide(bad)
    monkeypatch.setattr(matvec, "FP8_GEMV_VARIANT", "_r2u2")
    monkeypatch.setattr(matvec, "FP8_GEMV_WIDE", (16384, "_split"))
    assert [matvec.fp8_gemv_variant_for(n) for n in (4096, 6144, 16383, 16384, 28672)] == [
        "_r2u2",
        "_r2u2",
        "_r2u2",
        "_split",
        "_split",
    ]
    monkeypatch.setattr(matvec, "FP8_GEMV_WIDE", None)
    assert matvec.fp8_gemv_variant_for(28672) == "_r2u2"


def test_overlaps_compares_byte_ranges():
    """The fused LoRA-shrink wrappers refuse an output that shares any byte with an input."""
    from zllm.workers.kernels.checks import overlaps

    buffer = torch.zeros(64, dtype=torch.bfloat16)
    assert overlaps(buffer[:32], buffer[16:48])  # part of the same bytes, different starts
    assert overlaps(buffer[:32], buffer[:32])
    assert not overlaps(buffer[:32], buffer[32:])  # adjacent
    assert not overlaps(buffer[:0], buffer)  # empty
    assert not overlaps(buffer, torch.zeros(64, dtype=torch.bfloat16))
