"""Summarise ZLLM_STEP_TRACE files: one row per engine and per worker, and each engine's batch over time.

    ZLLM_STEP_TRACE=/tmp/w1 python benchmarks/throughput.py ... --dp 2
    python benchmarks/step_trace_summary.py /tmp/w1 [--since-last-idle] [--bins 10]

Reads PREFIX.dp<rank>.jsonl (zllm/enginecore/step_trace.py). A run's warm-up shares the files;
--since-last-idle keeps, per engine, only the steps after its last idle stretch that began with
arrivals (the measured generate call). Prints JSON: per engine the steps, mean requests and tokens
per submitted step, preemptions, the most waiting, when its requests arrived (first, median and
last arrival, seconds from the earliest step of any engine), its first and last step, the core's
time in steps (busy), waiting for the workers (wait) and away between steps (gap); then, per
engine, the mean running batch in each of --bins equal slices of the whole run; then per worker
(PREFIX.dp<rank>.worker<tp rank>.jsonl) its pure decode steps at the largest batch it ran (rows
at least 90% of its most): their count, and the medians of the period between step starts and
of each part of a step (idle: waiting for the step to arrive; launch: inputs built, forward
queued; finish: the previous step answered, of which sync: blocked on its tokens, i.e. the
device was still busy; sample). A worker whose sync is near 0 starves its device: the host is
the bound; one whose sync is most of the period is bound by the device.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics


def load(prefix: str, pattern: str) -> dict[str, list[dict]]:
    """The step lines of every file PREFIX.<name>.jsonl whose name matches `pattern`, by name."""
    traces = {}
    for path in glob.glob(f"{glob.escape(prefix)}.dp*.jsonl"):
        name = path[len(prefix) + 1 : -len(".jsonl")]
        if re.fullmatch(pattern, name):
            with open(path) as file:
                traces[name] = [json.loads(line) for line in file if line.strip()]
    return dict(sorted(traces.items()))


def last_batch(lines: list[dict]) -> list[dict]:
    """The lines from the last arrival at an empty engine (the measured call, after a warm-up)."""
    start = 0
    for index, line in enumerate(lines):
        before = lines[index - 1] if index else None
        if line["arrived"] and (before is None or before["running"] + before["waiting"] == 0):
            start = index
    return lines[start:]


def since(lines: list[dict], start: float) -> list[dict]:
    return [line for line in lines if line["t"] >= start]


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


def worker_summary(name: str, lines: list[dict]) -> dict:
    """A worker's pure decode steps at (near) its largest batch: medians of the period and its parts."""
    decodes = [line for line in lines if line["rows"] and line["tokens"] == line["rows"]]
    most = max((line["rows"] for line in decodes), default=0)
    full = [line for line in decodes if line["rows"] >= 0.9 * most]
    periods = [b["t"] - b["busy_s"] - (a["t"] - a["busy_s"]) for a, b in zip(full, full[1:])]

    def median_ms(values) -> float | None:
        values = list(values)
        return round(1000 * statistics.median(values), 2) if values else None

    parts = ("idle_s", "launch_s", "finish_s", "sync_s", "sample_s")
    return {
        "worker": name,
        "steps": len(lines),
        "decode_steps_at_batch": len(full),
        "batch": most,
        "period_ms": median_ms(p for p in periods if p < 1.0),  # a gap of a second is not a step
        **{part.replace("_s", "_ms"): median_ms(line[part] for line in full) for part in parts},
    }


def _quantiles_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"median": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": round(1000 * ordered[-1], 2)}


def by_prefill(rank: int, lines: list[dict], bucket: int) -> list[dict]:
    """Per bucket of prompt tokens a step carried: the step's own period and the next one's."""
    submitted = [line for line in lines if "reqs" in line]
    starts = [line["t"] - line["busy_s"] for line in submitted]
    groups: dict[int, tuple[list[float], list[float]]] = {}
    for index in range(len(submitted) - 2):
        own, after = starts[index + 1] - starts[index], starts[index + 2] - starts[index + 1]
        if own > 1.0 or after > 1.0:  # idle between loads, not a step
            continue
        tokens = submitted[index]["prefill_tokens"]
        key = 0 if tokens == 0 else (tokens - 1) // bucket + 1
        periods = groups.setdefault(key, ([], []))
        periods[0].append(own)
        periods[1].append(after)
    rows = []
    for key, (own, after) in sorted(groups.items()):
        label = "0" if key == 0 else f"{(key - 1) * bucket + 1}-{key * bucket}"
        rows.append(
            {"dp": rank, "prefill_tokens": label, "steps": len(own), "period_ms": _quantiles_ms(own)}
            | {"next_period_ms": _quantiles_ms(after)}
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="the ZLLM_STEP_TRACE value of the run")
    parser.add_argument("--since-last-idle", action="store_true", help="only each engine's last batch of requests")
    parser.add_argument("--bins", type=int, default=10)
    parser.add_argument("--by-prefill", action="store_true", help="step periods by the prompt tokens a step carried")
    parser.add_argument("--bucket", type=int, default=128, help="prompt tokens per --by-prefill group")
    args = parser.parse_args()
    traces = {int(name[2:]): lines for name, lines in load(args.prefix, r"dp\d+").items()}
    if args.since_last_idle:
        traces = {rank: last_batch(lines) for rank, lines in traces.items()}
    traces = {rank: lines for rank, lines in traces.items() if lines}
    if not traces:
        raise SystemExit(f"no step lines under {args.prefix}.dp*.jsonl")
    workers = load(args.prefix, r"dp\d+\.worker\d+")
    origin = min(_start(lines[0]) for lines in traces.values())
    end = max(lines[-1]["t"] for lines in traces.values())
    print(json.dumps({"elapsed_s": round(end - origin, 3)}))
    for rank, lines in traces.items():
        print(json.dumps(summarise(rank, lines, origin)))
    for rank, lines in traces.items():
        print(json.dumps({"dp": rank, "running_by_time": batch_over_time(lines, origin, end, args.bins)}))
    for name, lines in workers.items():
        if lines := since(lines, origin):
            print(json.dumps(worker_summary(name, lines)))
    if args.by_prefill:
        for rank, lines in traces.items():
            for row in by_prefill(rank, lines, args.bucket):
                print(json.dumps(row))


if __name__ == "__main__":
    main()
