"""Summarise ZLLM_STEP_TRACE files: one row per engine, and each engine's batch over time.

    ZLLM_STEP_TRACE=/tmp/w1 python benchmarks/throughput.py ... --dp 2
    python benchmarks/step_trace_summary.py /tmp/w1 [--since-last-idle] [--bins 10]

Reads PREFIX.dp<rank>.jsonl (zllm/enginecore/step_trace.py). A run's warm-up shares the files;
--since-last-idle keeps, per engine, only the steps after its last idle stretch that began with
arrivals (the measured generate call). Prints JSON: per engine the steps, mean requests and tokens
per submitted step, preemptions, the most waiting, when its requests arrived (first, median and
last arrival, seconds from the earliest step of any engine), its first and last step, the core's
time in steps (busy), waiting for the workers (wait) and away between steps (gap); then, per
engine, the mean running batch in each of --bins equal slices of the whole run.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics


def load(prefix: str) -> dict[int, list[dict]]:
    """Each engine's step lines, by dp rank."""
    traces = {}
    for path in glob.glob(f"{glob.escape(prefix)}.dp*.jsonl"):
        match = re.search(r"\.dp(\d+)\.jsonl$", path)
        if match:
            with open(path) as file:
                traces[int(match.group(1))] = [json.loads(line) for line in file if line.strip()]
    return dict(sorted(traces.items()))


def last_batch(lines: list[dict], idle_s: float = 0.5) -> list[dict]:
    """The lines from the last step that followed an idle gap of at least idle_s and brought arrivals."""
    start = 0
    for index, line in enumerate(lines):
        if line["gap_s"] >= idle_s and line["arrived"]:
            start = index
    return lines[start:]


def arrival_times(lines: list[dict], origin: float) -> list[float]:
    """One time (seconds from origin) per request arrived, spread evenly over each line's
    first-to-last arrival."""
    times = []
    for line in lines:
        count = line["arrived"]
        if count:
            first, last = line["arrived_t0"] - origin, line["arrived_t1"] - origin
            times += [first + (last - first) * i / max(1, count - 1) for i in range(count)]
    return times


def summarise(rank: int, lines: list[dict], origin: float) -> dict:
    submitted = [line for line in lines if "reqs" in line]
    arrivals = arrival_times(lines, origin)
    return {
        "dp": rank,
        "steps": len(submitted),
        "mean_reqs": round(statistics.fmean(s["reqs"] for s in submitted), 1) if submitted else 0,
        "mean_tokens": round(statistics.fmean(s["tokens"] for s in submitted), 1) if submitted else 0,
        "preemptions": lines[-1]["preemptions"] - lines[0]["preemptions"] if lines else 0,
        "max_waiting": max((line["waiting"] for line in lines), default=0),
        "requests": len(arrivals),
        "arrival_first_s": round(arrivals[0], 3) if arrivals else None,
        "arrival_median_s": round(statistics.median(arrivals), 3) if arrivals else None,
        "arrival_last_s": round(arrivals[-1], 3) if arrivals else None,
        "first_step_s": round(lines[0]["t"] - lines[0]["busy_s"] - origin, 3) if lines else None,
        "last_step_s": round(lines[-1]["t"] - origin, 3) if lines else None,
        "busy_s": round(sum(line["busy_s"] for line in lines), 3),
        "wait_s": round(sum(line["wait_s"] for line in lines), 3),
        "gap_s": round(sum(line["gap_s"] for line in lines[1:]), 3),
    }


def _start(line: dict) -> float:
    """When the line's step began, or its first request arrived if earlier (the offline dp 1 loop
    adds every request before its first step)."""
    return min(line["t"] - line["busy_s"], line.get("arrived_t0", line["t"]))


def batch_over_time(lines: list[dict], origin: float, end: float, bins: int) -> list[float]:
    """The mean `running` of the engine's steps in each of `bins` equal slices of [origin, end]."""
    width = (end - origin) / bins or 1.0
    sums, counts = [0.0] * bins, [0] * bins
    for line in lines:
        index = min(bins - 1, int((line["t"] - origin) / width))
        sums[index] += line["running"]
        counts[index] += 1
    return [round(s / c, 1) if c else 0.0 for s, c in zip(sums, counts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="the ZLLM_STEP_TRACE value of the run")
    parser.add_argument("--since-last-idle", action="store_true", help="only each engine's last batch of requests")
    parser.add_argument("--bins", type=int, default=10)
    args = parser.parse_args()
    traces = load(args.prefix)
    if args.since_last_idle:
        traces = {rank: last_batch(lines) for rank, lines in traces.items()}
    traces = {rank: lines for rank, lines in traces.items() if lines}
    if not traces:
        raise SystemExit(f"no step lines under {args.prefix}.dp*.jsonl")
    origin = min(_start(lines[0]) for lines in traces.values())
    end = max(lines[-1]["t"] for lines in traces.values())
    print(json.dumps({"elapsed_s": round(end - origin, 3)}))
    for rank, lines in traces.items():
        print(json.dumps(summarise(rank, lines, origin)))
    for rank, lines in traces.items():
        print(json.dumps({"dp": rank, "running_by_time": batch_over_time(lines, origin, end, args.bins)}))


if __name__ == "__main__":
    main()
