"""The soak benchmark's short CI variant (benchmarks/soak.py): a few hundred requests over HTTP and
ZMQ, with aborts, vanishing clients, bad requests and n > 1, against a real `vllm-launch` on CPU.
Afterwards every KV block is free, nothing runs or waits, and no process grew past the bounds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_short_soak_leaves_the_server_as_it_found_it(tmp_path, smollm2_dir):
    report, picture = tmp_path / "soak.json", tmp_path / "soak.png"
    command = [
        sys.executable,
        "benchmarks/soak.py",
        "--num-requests",
        "240",
        "--warmup",
        "24",
        "--concurrency",
        "16",
        "--input-len",
        "4:24",
        "--output-len",
        "1:4",
        "--sample-interval",
        "1",
        "--quiet-period",
        "2",
        "--request-timeout",
        "60",
        "--json",
        str(report),
        "--plot",
        str(picture),
        "--",
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "128MiB",
    ]
    soak = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = soak.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        soak.terminate()  # the soak stops its server on the way out
        out, err = soak.communicate(timeout=60)
        pytest.fail(f"the soak took over 300 s:\n{err[-3000:]}")
    assert report.exists(), out + err[-3000:]
    result = json.loads(report.read_text())
    failed = [check for check in result["checks"] if not check["ok"]]
    assert soak.returncode == 0 and not failed, (failed, result["unexpected"])
    seen = {tuple(key.split()[:2]) for key in result["outcomes"]}
    kinds = ("complete", "n", "abort", "disconnect", "bad")
    assert seen == {(transport, kind) for transport in ("http", "zmq") for kind in kinds}
    assert {"frontend", "engine core", "worker 0", "client (this soak)"} <= set(result["final"]["processes"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert picture.stat().st_size > 10_000
