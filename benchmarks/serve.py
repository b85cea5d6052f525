"""Online serving benchmark against the OpenAI-compatible HTTP API of a running server.

    vllm-launch --port 8000 &                       # or any OpenAI-compatible server
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 2 \\
        --dataset random --input-len 64:256 --output-len 32:128 --json out.json --plot out.png

Requests arrive as a Poisson process at --request-rate per second (exponential gaps, --seed), or
all at once with --arrival burst. Each is a streaming /v1/completions call whose prompt is random
token ids (so its length is exact) and whose max_tokens is its output length, with ignore_eos, so
every request produces exactly that many tokens. Lengths come from
  --dataset random        uniform in --input-len / --output-len ranges ("128" or "16:256")
  --dataset sharegpt-like log-normal lengths with ShareGPT's long tail (a synthetic stand-in: the
                          conversations themselves are not used), medians --input-len/--output-len
                          (their lower bounds), sigma 1.0 (input) and 0.8 (output), clipped to the
                          ranges' upper bounds.
Measured per request: TTFT (request sent -> first text chunk), ITL (gaps between text chunks),
TPOT ((end - first chunk) / (tokens - 1)) and end-to-end latency; reported as mean, median and
p99 in ms, with request and token throughput, as one JSON object (stdout and --json). --plot
draws TTFT and latency per request over the run, the ITL distribution and tokens/s over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.throughput import make_workload, parse_range  # noqa: E402


@dataclass(slots=True)
class Result:
    """One request as the client saw it (seconds since the start of the run)."""

    sent: float
    prompt_len: int
    output_len: int
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def latency(self) -> float:
        return self.end - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.end - self.chunk_times[0]) / (self.tokens - 1) if self.tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


# ---- workload -------------------------------------------------------------------------------------


def sharegpt_like_workload(num: int, input_len: str, output_len: str, vocab_size: int, seed: int):
    rng = random.Random(seed)
    (in_median, in_max), (out_median, out_max) = parse_range(input_len), parse_range(output_len)

    def length(median: int, cap: int, sigma: float) -> int:
        return max(4, min(cap, round(rng.lognormvariate(math.log(median), sigma))))

    prompts, outputs = [], []
    for _ in range(num):
        prompts.append([rng.randrange(100, vocab_size) for _ in range(length(in_median, in_max, 1.0))])
        outputs.append(length(out_median, out_max, 0.8))
    return prompts, outputs


def arrival_times(num: int, rate: float, arrival: str, seed: int) -> list[float]:
    if arrival == "burst" or math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed + 1)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


# ---- the client -----------------------------------------------------------------------------------


async def one_request(session, args, prompt: list[int], output_len: int, start: float) -> Result:
    import aiohttp

    result = Result(sent=time.perf_counter() - start, prompt_len=len(prompt), output_len=output_len)
    body = {
        "model": args.model_name,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with session.post(f"{args.base_url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:
                await _read_event(line, result, start)
    except aiohttp.ClientError as error:
        result.error = f"{type(error).__name__}: {error}"
    result.end = time.perf_counter() - start
    if result.error is None and result.tokens != output_len:
        result.error = f"expected {output_len} tokens, got {result.tokens}"
    return result


async def _read_event(line: bytes, result: Result, start: float) -> None:
    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
        return
    chunk = json.loads(line[6:])
    if "error" in chunk:
        result.error = chunk["error"]["message"]
    elif chunk.get("usage"):
        result.tokens = chunk["usage"]["completion_tokens"]
    elif chunk["choices"] and chunk["choices"][0]["text"]:
        result.chunk_times.append(time.perf_counter() - start)


async def run(args, prompts, outputs, arrivals) -> tuple[list[Result], float]:
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        args.model_name = (
            args.model_name or (await (await session.get(f"{args.base_url}/v1/models")).json())["data"][0]["id"]
        )
        await one_request(session, args, prompts[0][:8], 4, time.perf_counter())  # warm-up
        start = time.perf_counter()

        async def at(when: float, prompt, output_len) -> Result:
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - start)))
            return await one_request(session, args, prompt, output_len, start)

        results = await asyncio.gather(*[at(t, p, o) for t, p, o in zip(arrivals, prompts, outputs)])
        return results, time.perf_counter() - start


# ---- report -----------------------------------------------------------------------------------------


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "median": math.nan, "p99": math.nan}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "mean": round(statistics.fmean(values) * 1e3, 2),
        "median": round(statistics.median(values) * 1e3, 2),
        "p99": round(p99 * 1e3, 2),
    }


def report(args, results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.error is None]
    out_tokens = sum(r.tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    return {
        "base_url": args.base_url,
        "model": args.model_name,
        "dataset": args.dataset,
        "arrival": args.arrival,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "num_prompts": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(done) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 1),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 1),
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_ms": _summary([r.ttft for r in done if r.chunk_times]),
        "tpot_ms": _summary([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": _summary([gap for r in done for gap in r.itls]),
        "e2e_latency_ms": _summary([r.latency for r in done]),
    }


def plot(path: str, results: list[Result], summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = sorted((r for r in results if r.error is None and r.chunk_times), key=lambda r: r.sent)
    figure, axes = plt.subplots(2, 2, figsize=(12, 8))
    sent = [r.sent for r in done]
    axes[0][0].scatter(sent, [r.ttft * 1e3 for r in done], s=8, label="TTFT")
    axes[0][0].scatter(sent, [r.latency * 1e3 for r in done], s=8, label="end-to-end")
    axes[0][0].set(xlabel="request sent at (s)", ylabel="ms", title="Latency per request", yscale="log")
    axes[0][0].legend()
    itls = [gap * 1e3 for r in done for gap in r.itls]
    axes[0][1].hist(itls, bins=60)
    axes[0][1].set(xlabel="inter-token latency (ms)", ylabel="chunks", title="ITL distribution")
    times = [t for r in done for t in r.chunk_times]
    if times:
        bins = max(1, math.ceil(max(times)))
        axes[1][0].hist(times, bins=bins, range=(0, bins))
    axes[1][0].set(xlabel="time (s)", ylabel="text chunks per second (≈ tokens/s)", title="Output over time")
    in_flight = sorted([(r.sent, 1) for r in done] + [(r.end, -1) for r in done])
    level, xs, ys = 0, [], []
    for when, step in in_flight:
        level += step
        xs.append(when)
        ys.append(level)
    axes[1][1].step(xs, ys, where="post")
    axes[1][1].set(xlabel="time (s)", ylabel="requests", title="Requests in flight")
    arrival = "burst" if summary["request_rate"] is None else f"{summary['arrival']} at {summary['request_rate']} req/s"
    figure.suptitle(
        f"{summary['model']}: {summary['completed']} requests ({summary['dataset']}), {arrival}; "
        f"{summary['output_token_throughput']} output tok/s"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model-name", default=None, help="the served model (default: the server's first)")
    parser.add_argument(
        "--model",
        default=None,
        help="HF directory whose vocabulary sizes the random prompts (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: burst)")
    parser.add_argument("--arrival", choices=["poisson", "burst"], default="poisson")
    parser.add_argument("--dataset", choices=["random", "sharegpt-like"], default="random")
    parser.add_argument("--input-len", default="64:256")
    parser.add_argument("--output-len", default="32:128")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds without a byte before giving up")
    parser.add_argument("--json", default=None, help="also write the report here")
    parser.add_argument("--plot", default=None, help="draw the run into this PNG")
    args = parser.parse_args()

    from transformers import AutoConfig

    from zllm.model_files import resolve_model_dir

    vocab_size = AutoConfig.from_pretrained(resolve_model_dir(args.model)).vocab_size
    workload = make_workload if args.dataset == "random" else sharegpt_like_workload
    prompts, outputs = workload(args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed)
    arrivals = arrival_times(args.num_prompts, args.request_rate, args.arrival, args.seed)
    results, duration = asyncio.run(run(args, prompts, outputs, arrivals))
    summary = report(args, results, duration)
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        plot(args.plot, results, summary)


if __name__ == "__main__":
    main()
