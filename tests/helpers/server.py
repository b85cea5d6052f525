"""`vllm-launch` as a real process tree (start, stop, its engine's processes), and waiting on
processes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil

# Two cores shared by several processes: a second torch thread per worker only spins.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def processes_gone(pids: list[int]) -> bool:
    """Every one of these processes has exited (a zombie counts as gone: it holds no memory)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class ServerHandle:
    """A `vllm-launch` server running as a real process tree."""

    def __init__(self, process, endpoint: str, runtime_dir: str, log_path: Path) -> None:
        self.process = process
        self.endpoint = endpoint
        self.runtime_dir = runtime_dir
        self.log_path = log_path
        self.http_url = ""  # the OpenAI-compatible API's base URL, from the ready line

    def read_http_url(self) -> None:
        import re

        match = re.search(r"zllm ready: .* and (http://\S+) ", self.log())
        self.http_url = match.group(1) if match else ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_dir(self) -> Path:
        """The runtime subdirectory of the current engine (engine-1, then engine-2 after a restart...)."""
        return max(Path(self.runtime_dir).glob("engine-*"), key=lambda path: int(path.name.split("-")[1]))

    def children(self):
        return psutil.Process(self.process.pid).children(recursive=True)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the server drains); a server still there after `timeout` is killed, with its
        engine processes, and the test fails rather than leave them running."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            leftovers = self.children()
            self.process.kill()
            for child in leftovers:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            self.process.wait(30)
            raise


def start_server(
    directory: Path,
    model_dir: str,
    *extra: str,
    timeout: float = 180.0,
    endpoint: str | None = None,
    env: dict[str, str] | None = None,
) -> ServerHandle:
    """Start vllm-launch (with these environment variables added) and wait for its ready line."""
    import subprocess
    import sys
    import time

    runtime_dir = directory / "rt"
    endpoint = endpoint or f"ipc://{directory}/client.sock"
    log_path = directory / "server.log"
    command = [
        sys.executable,
        "-m",
        "zllm.launch.cli",
        "--model",
        model_dir,
        "--zmq-endpoint",
        endpoint,
        "--runtime-dir",
        str(runtime_dir),
        "--kv-cache-memory",
        "256MiB",
        "--max-model-len",
        "2048",
        "--port",
        "0",
        *extra,
    ]  # port 0: a free port, so servers started in parallel never clash
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None
        )
    handle = ServerHandle(process, endpoint, str(runtime_dir), log_path)
    deadline = time.monotonic() + timeout
    while "zllm ready" not in handle.log():
        if process.poll() is not None or time.monotonic() > deadline:
            handle.stop()
            raise RuntimeError(f"server did not start:\n{handle.log()[-3000:]}")
        time.sleep(0.2)
    handle.read_http_url()
    return handle


def engine_processes(handle: ServerHandle) -> tuple[psutil.Process, list[psutil.Process]]:
    """The server's engine-core process and its children (the workers)."""
    core = next(p for p in handle.children() if "zllm.enginecore.process" in " ".join(p.cmdline()))
    return core, core.children()
