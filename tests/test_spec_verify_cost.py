"""benchmarks/spec_verify_cost.py --profile on CPU, on a tiny random Llama: one JSON line per step
kind whose categories account for the profiled busy time, its top kernels and its phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.models import save_tiny_llama

from benchmarks.spec_verify_cost import CATEGORIES, PHASES, category_of

ROOT = Path(__file__).resolve().parent.parent


def test_names_fall_into_their_categories():
    assert category_of("paged_attention_decode_bf16_d128") == "attention"
    assert category_of("gemv_rows_bf16_mma_g1_s4") == "linear"
    assert category_of("aten::cumprod") == "sampling"
    assert category_of("Memcpy HtoD (Pinned -> Device)") == "copies"
    assert category_of("fused_add_rms_norm_bf16") == "other"


def test_profile_prints_where_each_step_kind_spends_its_time(tmp_path):
    model = save_tiny_llama(tmp_path / "tiny")
    command = [sys.executable, "benchmarks/spec_verify_cost.py", "--model", str(model), "--max-model-len", "128"]
    command += ["--k", "3", "--context", "16", "--iters", "3", "--profile", "--profile-steps", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the script imports zllm from this tree
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    profiles = {line["profile"]: line for line in lines if "profile" in line}
    assert set(profiles) == {"plain", "verify"}
    for profile in profiles.values():
        categories = profile["categories_ms"]
        assert set(categories) == {*(c for c, _ in CATEGORIES), "other"}
        assert abs(sum(categories.values()) - profile["device_busy_ms"]) < 0.01
        assert profile["device_busy_ms"] > 0 and categories["linear"] > 0
        assert abs(profile["host_ms"] - (profile["wall_ms"] - profile["device_busy_ms"])) < 0.002
        assert set(profile["phases_ms"]) == set(PHASES.values()) and profile["phases_ms"]["forward"] > 0
        assert 0 < len(profile["top_kernels"]) <= 15
        times = [kernel["ms"] for kernel in profile["top_kernels"]]
        assert times == sorted(times, reverse=True)
        assert categories["sampling"] > 0  # the argmax; with drafts, the rejection sampler's ops too
    summary = lines[-1]
    assert summary["k"] == 3 and summary["plain_step_ms"] > 0 and summary["verify_step_ms"] > 0
