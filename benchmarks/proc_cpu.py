"""CPU use of a served run's processes, sampled while a load runs (issue 30: is one frontend the limit?).

    python benchmarks/proc_cpu.py --root SERVER_PID [--client-match vllm_benchmark_serving] \
        [--interval 1.0] [--seconds 120] > cpu.jsonl
    python benchmarks/proc_cpu.py --top-stacks PROFILE.txt   (py-spy record -f raw: where the time went)

Every INTERVAL seconds, one JSON line: the CPU share (100 = one core busy) of each process under
the server's root process, by role (launcher: vllm-launch itself, the frontend unless
--api-server-count started several; frontend: one of those; core: an engine core; worker: a GPU
worker; other), and of every process whose command line contains CLIENT_MATCH (the
load generator). Stops after SECONDS, when the root exits, or on SIGTERM, and then prints one
summary line: per process, the mean and the peak of its busy samples (those above 5%). A role
pinned near 100 while the load falls behind is the bound; all well under it says it is not.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time

import psutil

ROLES = (
    ("zllm.launch.api_server_process", "frontend"),  # one of vllm-launch --api-server-count's
    ("zllm.enginecore.process", "core"),
    ("zllm.workers.process", "worker"),
)


def role_of(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    return next((role for marker, role in ROLES if marker in command), "other")


def watched(root: psutil.Process, client_match: str) -> dict[int, tuple[str, psutil.Process]]:
    # vllm-launch itself: the frontend, or with several API servers their supervisor
    found = {root.pid: ("launcher", root)}
    for child in root.children(recursive=True):
        try:
            found[child.pid] = (role_of(child), child)
        except psutil.Error:
            continue
    if client_match:
        for process in psutil.process_iter(["cmdline"]):
            if client_match in " ".join(process.info["cmdline"] or ()):
                found.setdefault(process.pid, ("client", process))
    return found


def top_stacks(path: str, count: int = 25) -> None:
    """The functions that most samples of a py-spy raw profile (collapsed stacks) were in, whole
    (inclusive) and at the top of the stack (self)."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    with open(path) as profile:
        for line in profile:
            stack, _, samples = line.rstrip().rpartition(" ")
            if not stack or not samples.isdigit():
                continue
            frames, weight = stack.split(";"), int(samples)
            total += weight
            for frame in set(frames):
                inclusive[frame] = inclusive.get(frame, 0) + weight
            own[frames[-1]] = own.get(frames[-1], 0) + weight
    for title, table in (("inclusive", inclusive), ("self", own)):
        print(f"== {title} ({total} samples)")
        for frame, weight in sorted(table.items(), key=lambda item: -item[1])[:count]:
            print(f"{100 * weight / max(total, 1):6.1f}%  {frame}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top-stacks", default=None, help="summarize a py-spy raw profile and exit")
    parser.add_argument("--root", type=int, default=None, help="the server's pid (vllm-launch)")
    parser.add_argument("--client-match", default="vllm_benchmark_serving")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    if args.top_stacks:
        return top_stacks(args.top_stacks)
    if args.root is None:
        parser.error("--root is required")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    root = psutil.Process(args.root)
    samples: dict[str, list[float]] = {}
    # One psutil.Process per pid for the whole run: cpu_percent() measures since the same
    # object's previous call (a fresh object's first call says 0).
    tracked: dict[int, tuple[str, psutil.Process]] = {}
    started = time.monotonic()
    while not stop and time.monotonic() - started < args.seconds and root.is_running():
        for pid, (role, process) in watched(root, args.client_match).items():
            if pid not in tracked:
                try:
                    process.cpu_percent(None)
                except psutil.Error:
                    continue
                tracked[pid] = (role, process)
        time.sleep(args.interval)
        line = {"t": round(time.monotonic() - started, 2)}
        for pid, (role, process) in list(tracked.items()):
            try:
                share = process.cpu_percent(None)
            except psutil.Error:
                del tracked[pid]  # exited
                continue
            key = f"{role}:{pid}"
            line[key] = share
            samples.setdefault(key, []).append(share)
        print(json.dumps(line), flush=True)
    summary = {}
    for key, values in samples.items():
        busy = [v for v in values if v > 5.0]
        if busy:
            summary[key] = {"mean_busy": round(statistics.fmean(busy), 1), "peak": max(busy), "busy_samples": len(busy)}
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
