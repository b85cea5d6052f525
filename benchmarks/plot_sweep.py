"""Latency against request rate, from vLLM's client's result files: a PNG and a markdown table.

    python benchmarks/plot_sweep.py RESULTS_DIR_OR_JSON... --plot sweep.png [--title TEXT]

Reads the JSON files that vLLM's `benchmark_serving.py` writes with `--save-result` (run through
benchmarks/vllm_benchmark_serving.py; a directory stands for its *.json), one row per file, and
groups rows by their `label` (set with the client's `--metadata label=NAME`; "default" without
one). Files of one label and one rate (e.g. several single-prompt runs made one after another)
are merged into one row, their statistics computed again from the per-request lists the files
hold (successful requests only, as the client counts them).

Prints a markdown table: label, rate (req/s, "inf" for all at once), requests completed of those
sent, achieved req/s, TTFT median / p99, ITL median / mean / p99 (ms). With --plot, draws TTFT
and ITL medians and p99s against the rate, one line per label (a label with one rate: markers;
rows of rate "inf", all requests at once, are in the table only).
The p99s need the client's `--metric-percentiles` to include 99 (its default, "99"), else they
are computed from the per-request lists like the merged rows'.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np


def load_runs(paths: list[Path]) -> list[dict]:
    files = []
    for path in paths:
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    runs = []
    for file in files:
        data = json.loads(file.read_text())
        if "request_rate" not in data or "completed" not in data:
            continue  # not a result file of benchmark_serving.py
        data["_file"] = str(file)
        runs.append(data)
    return runs


def rate_value(run: dict) -> float:
    rate = run["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def successful(run: dict) -> list[int]:
    """Indices of the requests the client counted as successful (a TTFT and no error)."""
    errors = run.get("errors") or [""] * len(run["ttfts"])
    return [i for i, (ttft, error) in enumerate(zip(run["ttfts"], errors)) if ttft and ttft > 0 and not error]


def from_lists(runs: list[dict]) -> dict:
    """One row's figures from the per-request lists of these runs (made one after another)."""
    ttfts, itls, completed, sent, duration = [], [], 0, 0, 0.0
    for run in runs:
        ok = successful(run)
        ttfts += [run["ttfts"][i] for i in ok]
        itls += [gap for i in ok for gap in run["itls"][i]]
        completed += run["completed"]
        sent += run.get("num_prompts", len(run["ttfts"]))
        duration += run["duration"]
    ms = lambda values, q: float(np.percentile(values, q)) * 1000 if values else math.nan  # noqa: E731
    return {
        "completed": completed,
        "sent": sent,
        "requests_per_s": completed / duration if duration else math.nan,
        "ttft_median_ms": ms(ttfts, 50),
        "ttft_p99_ms": ms(ttfts, 99),
        "itl_median_ms": ms(itls, 50),
        "itl_mean_ms": float(np.mean(itls)) * 1000 if itls else math.nan,
        "itl_p99_ms": ms(itls, 99),
    }


def from_summary(run: dict) -> dict:
    """One file's figures as the client reported them (the lists fill in a missing p99)."""
    computed = None

    def pick(key: str, fallback: str) -> float:
        nonlocal computed
        if key in run:
            return float(run[key])
        computed = computed or from_lists([run])
        return computed[fallback]

    return {
        "completed": run["completed"],
        "sent": run.get("num_prompts", len(run["ttfts"])),
        "requests_per_s": float(run["request_throughput"]),
        "ttft_median_ms": pick("median_ttft_ms", "ttft_median_ms"),
        "ttft_p99_ms": pick("p99_ttft_ms", "ttft_p99_ms"),
        "itl_median_ms": pick("median_itl_ms", "itl_median_ms"),
        "itl_mean_ms": pick("mean_itl_ms", "itl_mean_ms"),
        "itl_p99_ms": pick("p99_itl_ms", "itl_p99_ms"),
    }


def rows_of(runs: list[dict]) -> list[dict]:
    groups: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for run in runs:
        groups[(run.get("label", "default"), rate_value(run))].append(run)
    rows = []
    for (label, rate), members in groups.items():
        figures = from_summary(members[0]) if len(members) == 1 else from_lists(members)
        rows.append({"label": label, "rate": rate, "runs": len(members), **figures})
    order = {label: i for i, label in enumerate(dict.fromkeys(label for label, _ in groups))}  # first seen first
    return sorted(rows, key=lambda row: (order[row["label"]], row["rate"]))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| label | rate (req/s) | completed | req/s | TTFT median / p99 (ms) | ITL median / mean / p99 (ms) |",
        "|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        rate = "inf" if math.isinf(row["rate"]) else f"{row['rate']:g}"
        runs = f" ({row['runs']} runs)" if row["runs"] > 1 else ""
        lines.append(
            f"| {row['label']}{runs} | {rate} | {row['completed']}/{row['sent']} | {row['requests_per_s']:.2f} | "
            f"{row['ttft_median_ms']:.1f} / {row['ttft_p99_ms']:.1f} | "
            f"{row['itl_median_ms']:.2f} / {row['itl_mean_ms']:.2f} / {row['itl_p99_ms']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft_axes, itl_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = list(dict.fromkeys(row["label"] for row in rows if math.isfinite(row["rate"])))  # "inf": table only
    for index, label in enumerate(labels):
        points = [row for row in rows if row["label"] == label and math.isfinite(row["rate"])]
        rates = [row["rate"] for row in points]
        color = f"C{index}"
        median_style, p99_style = ("-o", "--o") if len(points) > 1 else ("D", "s")
        for axes, metric in ((ttft_axes, "ttft"), (itl_axes, "itl")):
            axes.plot(
                rates, [r[f"{metric}_median_ms"] for r in points], median_style, color=color, label=f"{label} p50"
            )
            axes.plot(rates, [r[f"{metric}_p99_ms"] for r in points], p99_style, color=color, label=f"{label} p99")
    for axes, name in ((ttft_axes, "TTFT"), (itl_axes, "ITL")):
        axes.set_xlabel("request rate (req/s, Poisson)")
        axes.set_ylabel(f"{name} (ms)")
        axes.set_title(f"{name}: median and p99")
        axes.grid(True, alpha=0.3)
        axes.set_ylim(bottom=0)
        axes.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, nargs="+", help="result JSON files or directories of them")
    parser.add_argument("--plot", type=Path, default=None, help="write the PNG here")
    parser.add_argument("--title", default="vLLM's benchmark_serving.py against vllm-launch")
    args = parser.parse_args()
    runs = load_runs(args.results)
    if not runs:
        raise SystemExit(f"no result files of benchmark_serving.py in {', '.join(map(str, args.results))}")
    rows = rows_of(runs)
    print(markdown(rows))
    if args.plot is not None:
        plot(rows, args.plot, args.title)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
