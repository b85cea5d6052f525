"""Batch-1 inter-token latency: offline `LLM` engine vs served (`vllm-launch`) over HTTP and ZMQ.

    python benchmarks/served_itl.py [--model DIR] [--emulated-gpu 3.0] [--requests 5]
        [--input-len 128 --output-len 256] [--modes offline,http,zmq] [--trace] [-- ENGINE FLAGS...]

Issue 30: what the served path adds per output token at batch 1. One request at a time:
  offline  LLMEngine in a process of its own (the engine core and, at tp 1, the worker in it),
           stepped in a loop; a token's time is when its step's output comes back
           (detokenize=False, as benchmarks/latency.py's W2)
  http     a real `vllm-launch` subprocess; /v1/completions with stream=true, each SSE chunk's
           arrival time at this client (vLLM's benchmark_serving measures the same)
  zmq      the same server through zllm's AsyncClient.stream
ITL = the gaps between a request's consecutive tokens (chunks); reported as the median and the
mean over all gaps of all requests, and the served-minus-offline difference in microseconds.

Every engine flag after `--` goes to both the offline engine and the server (the offline
`EngineConfig` is built with usage="offline" and the server's with usage="serving", as `LLM`
and `vllm-launch` do; the fields on which the two differ are printed). --emulated-gpu SCALE runs
every process with benchmarks/emulated_gpu (a virtual device: a decode step costs
SCALE x 3.84 ms at batch 1, the model returns zeros), so the host's work is real and the device
time is a GPU's. Without it the (tiny) model runs on the CPU. --trace also writes ZLLM_STEP_TRACE
lines and reports, per mode, the engine core's steady period and its parts, the worker's, and the
delay from the core's step end to the client receiving that token (core -> frontend -> client).
The default model is a tiny Llama (1 layer, 64 wide, 4096 words: the host costs are not hidden
behind compute). Run on a quiet machine; the numbers are CPU figures, not GPU ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=4096,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


def tiny_model(target: Path) -> str:
    """A 1-layer Llama directory with a word-level tokenizer (every token id is one word)."""
    from benchmarks.dummy_model import write_dummy_model, write_placeholder_tokenizer

    write_dummy_model("llama3.2-1b", target)
    config = json.loads((target / "config.json").read_text())
    config.update(TINY)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    write_placeholder_tokenizer(target, vocab_size=TINY["vocab_size"])
    return str(target)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def child_env(args, trace_prefix: str | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)] + ([str(ROOT / "benchmarks" / "emulated_gpu")] if args.emulated_gpu else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.emulated_gpu:
        env["EMULATED_GPU_SCALE"] = str(args.emulated_gpu)
    env.pop("ZLLM_STEP_TRACE", None)
    if trace_prefix:
        env["ZLLM_STEP_TRACE"] = trace_prefix
    return env


def engine_config(model: str, flags: list[str], usage: str, **overrides):
    """The EngineConfig `vllm-launch FLAGS` builds (usage "serving"), or `LLM` given the same
    arguments (usage "offline": what this script's offline run uses), with `overrides`."""
    from zllm.config import EngineConfig
    from zllm.launch.args import engine_kwargs
    from zllm.launch.cli import build_parser

    parsed = build_parser().parse_args(["--model", model, *flags])
    return EngineConfig.create(model, usage=usage, **{**engine_kwargs(parsed), **overrides})


def config_differences(model: str, flags: list[str]) -> dict[str, dict]:
    """Fields on which the engines differ: this script's offline run against the server (the
    same flags: expect none), and benchmarks/latency.py's W2 (`LLM(max_num_seqs=8)`, the
    scheduler limits LLM raises on a GPU, prefix caching on) against the server."""
    import dataclasses

    served = engine_config(model, flags, "serving")
    w2 = engine_config(model, flags, "offline", max_num_seqs=8, max_num_batched_tokens=None, enable_prefix_caching=True)

    def differences(offline) -> dict[str, list]:
        names = [f.name for f in dataclasses.fields(served)]
        return {
            n: [getattr(offline, n), getattr(served, n)] for n in names if getattr(offline, n) != getattr(served, n)
        }

    return {"offline_vs_served": differences(engine_config(model, flags, "offline")), "w2_vs_served": differences(w2)}


# ---- offline (in a child process: `--child-offline`) ----------------------------------------------


def run_offline_child(args) -> None:
    """Print {"token_times": [[time.time() of each token] per request]}: a warm-up, then the measured ones."""
    from zllm import SamplingParams
    from zllm.launch.args import engine_kwargs
    from zllm.launch.cli import build_parser
    from zllm.launch.llm_engine import LLMEngine

    # As `vllm-launch --prompt` builds its LLM: the same flags, usage "offline".
    parsed = build_parser().parse_args(["--model", args.model, *args.engine_flags])
    engine = LLMEngine.from_engine_args(args.model, **engine_kwargs(parsed))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    batches = prompts(args.requests + 1, args.input_len, engine.processor.vocab_size, args.seed)
    runs = []
    for index, ids in enumerate(batches):
        engine.add_request(str(index), {"prompt_token_ids": ids}, params)
        times, seen = [], 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                count = len(output.outputs[0].token_ids)
                if count > seen:
                    times.append(time.time())
                    seen = count
        runs.append(times)
    print(json.dumps({"token_times": runs}))


def offline(args, trace_prefix: str | None) -> list[list[float]]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child-offline", "--model", args.model]
    command += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("requests", "input_len", "output_len")]
    command += [f"--seed={args.seed + args.modes.split(',').index('offline')}"]
    command += ["--", *args.engine_flags]
    done = subprocess.run(command, env=child_env(args, trace_prefix), capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"offline run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["token_times"]


# ---- served ---------------------------------------------------------------------------------------


class Server:
    def __init__(self, args, workdir: Path, trace_prefix: str | None) -> None:
        self.endpoint = f"ipc://{workdir}/client.sock"
        command = [sys.executable, "-m", "zllm.launch.cli", "--model", args.model, "--zmq-endpoint", self.endpoint]
        command += ["--port", "0", "--log-level", "WARNING", *args.engine_flags]
        self.process = subprocess.Popen(
            command, env=child_env(args, trace_prefix), stdout=subprocess.PIPE, stderr=sys.stderr, text=True
        )
        while "zllm ready" not in (line := self.process.stdout.readline()):
            if self.process.poll() is not None:
                raise RuntimeError("server failed to start")
        self.url = line.split(" and ")[1].split(" ")[0].rstrip("/")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


async def http_requests(url: str, batches: list[list[int]], output_len: int) -> list[list[float]]:
    import aiohttp

    runs = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as session:
        for ids in batches:
            body = {"prompt": ids, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": True}
            times = []
            async with session.post(f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.content:
                    if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        times.append(time.time())
            runs.append(times)
    return runs


async def zmq_requests(endpoint: str, batches: list[list[int]], output_len: int) -> list[list[float]]:
    from zllm import AsyncClient, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    runs = []
    async with AsyncClient(endpoint) as client:
        for ids in batches:
            times = []
            async for _ in client.stream(prompt_token_ids=ids, sampling_params=params):
                times.append(time.time())
            runs.append(times)
    return runs


# ---- report ---------------------------------------------------------------------------------------


def itl_summary(runs: list[list[float]]) -> dict:
    gaps = [b - a for times in runs for a, b in zip(times, times[1:])]
    tokens = [len(times) for times in runs]
    return {
        "requests": len(runs),
        "tokens_per_request": min(tokens) if tokens else 0,
        "itl_median_us": round(statistics.median(gaps) * 1e6, 1),
        "itl_mean_us": round(statistics.fmean(gaps) * 1e6, 1),
        "itl_p90_us": round(sorted(gaps)[int(0.9 * (len(gaps) - 1))] * 1e6, 1),
    }


def summary(runs: list[list[float]], trace_prefix: str | None) -> dict:
    """The measured requests' ITLs (runs[0] warmed up), and their step-trace breakdown."""
    result = itl_summary(runs[1:])
    if trace_prefix:
        result["trace"] = trace_summary(trace_prefix, runs[1:], after=runs[0][-1])
    return result


def read_trace(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as file:
        return [json.loads(line) for line in file if line.strip()]


def _median_us(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e6, 1) if values else None


def trace_summary(prefix: str, runs: list[list[float]], after: float) -> dict:
    """The core's and rank 0's decode steps after `after` (time.time(), the warm-up's end): medians
    of the core's period, time in step(), waiting for the workers and away between steps; the
    worker's parts; and each token's delay from the core's step end to this client."""
    core = [line for line in read_trace(f"{prefix}.dp0.jsonl") if line["t"] > after]
    decode = [line for line in core if line.get("deltas") == 1]
    worker = [line for line in read_trace(f"{prefix}.dp0.worker0.jsonl") if line["t"] > after]
    worker = [line for line in worker if line["rows"] == 1 and line["tokens"] == 1]
    token_ends = [line["t"] for line in decode]
    client = sorted(t for times in runs for t in times)
    # Token k's step line is the k-th line with a delta; both lists hold every measured token.
    delays = [c - t for t, c in zip(token_ends, client)] if len(token_ends) == len(client) else []
    return {
        "core_period_us": _median_us([b - a for a, b in zip(token_ends, token_ends[1:]) if b - a < 1.0]),
        "core_busy_us": _median_us([line["busy_s"] for line in decode]),
        "core_wait_us": _median_us([line["wait_s"] for line in decode]),
        "core_gap_us": _median_us([line["gap_s"] for line in core]),
        "worker": {
            key: _median_us([line[key] for line in worker])
            for key in ("idle_s", "launch_s", "finish_s", "sync_s", "sample_s")
        },
        "core_to_client_us": _median_us(delays),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: a tiny dummy Llama)")
    parser.add_argument("--requests", type=int, default=5, help="measured requests per mode (after one warm-up)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="offline,http,zmq")
    parser.add_argument("--emulated-gpu", type=float, default=0.0, help="virtual device scale (0: the CPU model)")
    parser.add_argument("--trace", action="store_true", help="ZLLM_STEP_TRACE breakdown per mode")
    parser.add_argument("--child-offline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("engine_flags", nargs="*", help="after --: engine flags for both paths")
    args = parser.parse_args()
    if args.child_offline:
        return run_offline_child(args)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.model is None:
            args.engine_flags = ["--load-format", "dummy", "--dtype", "float32", *args.engine_flags]
            args.model = tiny_model(workdir / "tiny")
        modes = args.modes.split(",")
        report: dict = {
            "model": args.model,
            "engine_flags": args.engine_flags,
            "emulated_gpu": args.emulated_gpu,
            "config_differences": config_differences(args.model, args.engine_flags),
        }
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        # Each mode its own prompts: the server's prefix cache must not serve one mode's prefill from another's.
        batches = {
            mode: prompts(args.requests + 1, args.input_len, vocab, args.seed + i) for i, mode in enumerate(modes)
        }
        if "offline" in modes:
            prefix = str(workdir / "offline") if args.trace else None
            runs = offline(args, prefix)
            report["offline"] = summary(runs, prefix)
        served = [m for m in modes if m in ("http", "zmq")]
        if served:
            prefix = str(workdir / "served") if args.trace else None
            server = Server(args, workdir, prefix)
            try:
                for mode in served:
                    if mode == "http":
                        runs = asyncio.run(http_requests(server.url, batches[mode], args.output_len))
                    else:
                        runs = asyncio.run(zmq_requests(server.endpoint, batches[mode], args.output_len))
                    report[mode] = summary(runs, prefix)
            finally:
                server.stop()
        if "offline" in report:
            for mode in served:
                report[f"{mode}_minus_offline_us"] = {
                    key: round(report[mode][key] - report["offline"][key], 1)
                    for key in ("itl_median_us", "itl_mean_us")
                }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
