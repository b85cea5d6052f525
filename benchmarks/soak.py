"""Soak test: many requests with cancels, disconnects and bad input; afterwards nothing may have leaked.

    python benchmarks/soak.py --num-requests 10000 --concurrency 32 --json soak.json --plot soak.png
    python benchmarks/soak.py --model DIR --load-format dummy --num-requests 50000 --concurrency 128 \\
        --input-len 16:1024 --output-len 1:128 --json soak.json --plot soak.png -- --max-model-len 2048

It starts `vllm-launch` itself (flags after `--` go to it), sends --warmup requests, takes the
baseline, then sends --num-requests requests at a fixed --concurrency: half over HTTP (streaming
or not /v1/completions, aiohttp), half over ZMQ (one shared AsyncClient, and now and then a fresh
one), each of random prompt length (--input-len, random token ids) and output length
(--output-len, ignore_eos), and of one kind:
  complete     reads the whole answer and checks its token count
  n            n = 2..4 completions, the same check
  abort        leaves the stream after a few deltas (ZMQ: the client sends an abort)
  disconnect   closes the connection mid-stream without a word (HTTP: the TCP connection; ZMQ: a
               raw DEALER socket, as a crashed client process does)
  bad          a request the server must refuse (400 / RequestError): ids outside the
               vocabulary, a prompt longer than max_model_len, too many logprobs, malformed JSON
Every --sample-interval seconds it records each process's RSS, open fds and threads (frontend,
engine core, workers, and this client process) and the engine's free KV blocks, running and
waiting requests. After the load and --quiet-period it checks:
  - free KV blocks == all KV blocks, running == waiting == 0, no request left in the frontend;
  - per process, growth from the baseline (after the warm-up) to the end of at most
    --max-rss-growth-mib of RSS, --max-fd-growth fds and --max-thread-growth threads;
  - every request ended as its kind must (none still running after --request-timeout).
--max-load-s bounds the load phase (a machine lent for a fixed time): no request starts after it.
It writes the samples and the checks to --json, draws them into --plot (matplotlib), and exits 1
if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KINDS = {"complete": 0.55, "n": 0.15, "abort": 0.1, "disconnect": 0.1, "bad": 0.1}
BAD_VARIANTS = ("out_of_vocab", "too_long", "too_many_logprobs", "malformed")  # malformed: HTTP only
READY = re.compile(r"zllm ready: .* on (\S+) and (http://\S+) ")


@dataclass(slots=True)
class Plan:
    """One request of the load, drawn in advance from --seed."""

    index: int
    transport: str  # "http" or "zmq"
    kind: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    stream: bool = True
    cut_after: int = 1  # abort / disconnect: deltas read first
    bad: str = ""
    fresh_client: bool = False  # ZMQ: connect a new AsyncClient for this request


@dataclass(slots=True)
class Server:
    process: subprocess.Popen
    endpoint: str
    base_url: str
    model_name: str = ""
    max_model_len: int = 0
    log_path: Path = Path()


@dataclass(slots=True)
class Sample:
    t: float
    phase: str  # warmup, load, quiet
    completed: int
    processes: dict[str, dict[str, float]]  # name -> rss_mib, fds, threads, cpu_s (user + system)
    engine: dict[str, int]  # KV blocks (all, free), requests (running, waiting, in the frontend), steps


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (transport, kind, outcome) -> count
    unexpected: list[str] = field(default_factory=list)  # the first few, in words
    completed: int = 0

    def record(self, plan: Plan, outcome: str) -> None:
        self.completed += 1
        self.outcomes[(plan.transport, plan.kind, "ok" if outcome == "ok" else "unexpected")] += 1
        if outcome != "ok" and len(self.unexpected) < 20:
            self.unexpected.append(
                f"#{plan.index} {plan.transport} {plan.kind}{'/' + plan.bad if plan.bad else ''}: {outcome}"
            )


# ---- the plan ---------------------------------------------------------------------------------------


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def make_plans(count: int, first: int, args, vocab_size: int, max_model_len: int) -> Iterator[Plan]:
    """Drawn as they are sent: a list of 50,000 prompts would grow this client's RSS by itself."""
    rng = random.Random(args.seed + first)
    for i in range(count):
        yield _plan(first + i, rng, args, vocab_size, max_model_len)


def _plan(index: int, rng: random.Random, args, vocab_size: int, max_model_len: int) -> Plan:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    transport = rng.choice(("http", "zmq"))
    max_tokens = rng.randint(*parse_range(args.output_len))
    prompt_len = min(rng.randint(*parse_range(args.input_len)), max_model_len - max_tokens)
    plan = Plan(index, transport, kind, [rng.randrange(100, vocab_size) for _ in range(prompt_len)], max_tokens)
    plan.stream = transport == "zmq" or kind in ("abort", "disconnect") or rng.random() < 0.7
    plan.n = rng.randint(2, 4) if kind == "n" else 1
    plan.cut_after = rng.randint(1, 3)
    plan.fresh_client = transport == "zmq" and rng.random() < 0.1
    if kind == "bad":
        plan.bad = rng.choice(BAD_VARIANTS if transport == "http" else BAD_VARIANTS[:-1])
        plan.prompt = _bad_prompt(plan, rng, vocab_size, max_model_len)
    return plan


def _bad_prompt(plan: Plan, rng: random.Random, vocab_size: int, max_model_len: int) -> list[int]:
    if plan.bad == "out_of_vocab":
        return plan.prompt + [vocab_size + rng.randrange(1, 1000)]
    if plan.bad == "too_long":
        return [rng.randrange(100, vocab_size) for _ in range(max_model_len + 1)]
    return plan.prompt


# ---- HTTP -------------------------------------------------------------------------------------------


async def http_request(session, server: Server, plan: Plan) -> str:
    """Run one planned request over HTTP; "ok" or what went wrong."""
    body = {
        "model": server.model_name,
        "prompt": plan.prompt,
        "max_tokens": plan.max_tokens,
        "n": plan.n,
        "ignore_eos": True,
        "stream": plan.stream,
        "temperature": 0.8,
    }
    if plan.stream:
        body["stream_options"] = {"include_usage": True}
    if plan.bad == "too_many_logprobs":
        body["logprobs"] = 1000
    data = b"{not json" if plan.bad == "malformed" else json.dumps(body).encode()
    async with session.post(
        f"{server.base_url}/v1/completions", data=data, headers={"Content-Type": "application/json"}
    ) as response:
        if plan.kind == "bad":
            return "ok" if response.status == 400 else f"HTTP {response.status} for a bad request"
        if response.status != 200:
            return f"HTTP {response.status}: {(await response.text())[:200]}"
        if not plan.stream:
            return _check_tokens(plan, (await response.json())["usage"]["completion_tokens"])
        return await _read_http_stream(response, plan)


async def _read_http_stream(response, plan: Plan) -> str:
    deltas = 0
    async for line in response.content:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return f"error event: {chunk['error']}"
        if chunk.get("usage"):
            return _check_tokens(plan, chunk["usage"]["completion_tokens"])
        deltas += 1
        if plan.kind in ("abort", "disconnect") and deltas >= plan.cut_after:
            response.close()  # the server sees the connection drop and aborts the request
            return "ok"
    return "ok" if plan.kind in ("abort", "disconnect") else "the stream ended without usage"


def _check_tokens(plan: Plan, tokens: int) -> str:
    expected = plan.n * plan.max_tokens
    return "ok" if tokens == expected else f"{tokens} tokens, expected {expected}"


# ---- ZMQ --------------------------------------------------------------------------------------------


async def zmq_request(shared_client, server: Server, plan: Plan) -> str:
    """Run one planned request over ZMQ; "ok" or what went wrong."""
    from zllm import AsyncClient

    if plan.kind == "disconnect":
        return await _vanish_mid_stream(server.endpoint, plan)
    if not plan.fresh_client:
        return await _zmq_on(shared_client, plan)
    async with AsyncClient(server.endpoint) as client:
        return await _zmq_on(client, plan)


async def _zmq_on(client, plan: Plan) -> str:
    from zllm import SamplingParams
    from zllm.client import RequestError

    params = SamplingParams(
        n=plan.n,
        max_tokens=plan.max_tokens,
        ignore_eos=True,
        temperature=0.8,
        logprobs=1000 if plan.bad == "too_many_logprobs" else None,
    )
    try:
        if plan.kind == "abort":
            return await _leave_early(client.stream(prompt_token_ids=plan.prompt, sampling_params=params), plan)
        output = await client.generate(prompt_token_ids=plan.prompt, sampling_params=params)
    except RequestError as error:
        return "ok" if plan.kind == "bad" else f"RequestError: {error}"
    if plan.kind == "bad":
        return "a bad request was served"
    return _check_tokens(plan, sum(len(completion.token_ids) for completion in output.outputs))


async def _leave_early(stream, plan: Plan) -> str:
    deltas = 0
    async for _ in stream:
        deltas += 1
        if deltas >= plan.cut_after:
            break  # leaving the stream aborts the request
    await stream.aclose()
    return "ok"


async def _vanish_mid_stream(endpoint: str, plan: Plan) -> str:
    """A client that disappears without aborting: a DEALER that closes after a few deltas."""
    import zmq
    import zmq.asyncio

    from zllm.ipc.codec import Codec
    from zllm.ipc.messages import ClientGenerate, ClientToServer, ServerToClient

    socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(endpoint)
        sampling = {"max_tokens": plan.max_tokens, "ignore_eos": True, "n": plan.n}
        await socket.send(
            Codec(ClientToServer).encode(
                ClientGenerate(f"vanish-{plan.index}", prompt_token_ids=plan.prompt, sampling=sampling)
            )
        )
        decoder = Codec(ServerToClient)
        for _ in range(plan.cut_after):
            message = decoder.decode(await socket.recv())
            if getattr(message, "finished", False):
                break
        return "ok"
    finally:
        socket.close(linger=0)


# ---- the load ---------------------------------------------------------------------------------------


async def run_plans(plans: Iterator[Plan], server: Server, args, tally: Tally, stop_at: float = math.inf) -> None:
    """Every plan, --concurrency at a time, none started after `stop_at` (monotonic time); a
    request that outlives --request-timeout is a failure."""
    import aiohttp

    from zllm import AsyncClient

    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    queue = iter(plans)
    async with (
        aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session,
        AsyncClient(server.endpoint, timeout=args.request_timeout) as client,
    ):

        async def worker() -> None:
            for plan in queue:
                if time.monotonic() > stop_at:
                    return
                tally.record(plan, await _bounded(plan, session, client, server, args.request_timeout))

        await asyncio.gather(*[worker() for _ in range(args.concurrency)])


async def _bounded(plan: Plan, session, client, server: Server, timeout_s: float) -> str:
    request = http_request(session, server, plan) if plan.transport == "http" else zmq_request(client, server, plan)
    try:
        return await asyncio.wait_for(request, timeout_s)
    except asyncio.TimeoutError:
        return f"no end after {timeout_s:.0f} s"
    except Exception as error:  # noqa: BLE001 - every failure is a finding, with its type
        return f"{type(error).__name__}: {error}"


# ---- sampling ---------------------------------------------------------------------------------------


def engine_processes(server: Server) -> dict[str, int]:
    """name -> pid: the frontend, the engine core, its workers, and this client process."""
    import psutil

    names = {"frontend": server.process.pid, "client (this soak)": os.getpid()}
    for child in psutil.Process(server.process.pid).children(recursive=True):
        command = " ".join(child.cmdline())
        if "zllm.enginecore.process" in command:
            names["engine core"] = child.pid
        elif "zllm.workers.process" in command:
            rank = command.split("--rank", 1)[1].split()[0] if "--rank" in command else str(len(names))
            names[f"worker {rank}"] = child.pid
    return names


def measure_process(pid: int) -> dict[str, float]:
    import psutil

    process = psutil.Process(pid)
    with process.oneshot():
        cpu = process.cpu_times()
        return {
            "rss_mib": round(process.memory_info().rss / 2**20, 1),
            "fds": process.num_fds(),
            "threads": process.num_threads(),
            "cpu_s": round(cpu.user + cpu.system, 1),
        }


async def take_sample(client, pids: dict[str, int], start: float, phase: str, completed: int) -> Sample:
    stats = await client.stats()
    engine = {
        key: stats[key]
        for key in ("num_kv_blocks", "num_free_kv_blocks", "num_running", "num_waiting", "num_requests", "num_steps")
    }
    processes = {name: measure_process(pid) for name, pid in pids.items()}
    return Sample(round(time.monotonic() - start, 2), phase, completed, processes, engine)


async def sample_every(interval: float, client, pids, start: float, state: dict, samples: list[Sample]) -> None:
    while True:
        samples.append(await take_sample(client, pids, start, state["phase"], state["tally"].completed))
        print(_progress(samples[-1]), file=sys.stderr, flush=True)
        await asyncio.sleep(interval)


def _progress(sample: Sample) -> str:
    engine = sample.engine
    rss = " ".join(f"{name.split()[0]} {p['rss_mib']:.0f}" for name, p in sample.processes.items())
    return (
        f"{sample.t:7.1f}s {sample.phase:6} done {sample.completed:6} | running {engine['num_running']:3} "
        f"waiting {engine['num_waiting']:3} free KV {engine['num_free_kv_blocks']}/{engine['num_kv_blocks']} | "
        f"RSS MiB {rss}"
    )


# ---- checks -----------------------------------------------------------------------------------------


def growth_bounds(args) -> dict[str, float]:
    return {"rss_mib": args.max_rss_growth_mib, "fds": args.max_fd_growth, "threads": args.max_thread_growth}


def check(baseline: Sample, final: Sample, tally: Tally, args) -> list[dict]:
    engine = final.engine
    checks = [
        _check(
            "free KV blocks back to the total",
            engine["num_free_kv_blocks"],
            engine["num_kv_blocks"],
            engine["num_free_kv_blocks"] == engine["num_kv_blocks"],
        ),
        _check(
            "engine running + waiting",
            engine["num_running"] + engine["num_waiting"],
            0,
            engine["num_running"] + engine["num_waiting"] == 0,
        ),
        _check("requests held by the frontend", engine["num_requests"], 0, engine["num_requests"] == 0),
        _check("requests that ended wrongly or hung", len(tally.unexpected), 0, not tally.unexpected),
    ]
    for name, before in baseline.processes.items():
        after = final.processes.get(name)
        for metric, bound in growth_bounds(args).items():
            growth = round(after[metric] - before[metric], 1) if after else math.inf
            checks.append(_check(f"{name}: {metric} growth", growth, bound, growth <= bound))
    return checks


def _check(name: str, value, bound, ok: bool) -> dict:
    return {"check": name, "value": value, "bound": bound, "ok": bool(ok)}


# ---- the server -------------------------------------------------------------------------------------


def start_server(args, workdir: Path) -> Server:
    command = [
        sys.executable,
        "-m",
        "zllm.launch.cli",
        "--zmq-endpoint",
        f"ipc://{workdir}/soak.sock",
        "--runtime-dir",
        str(workdir / "rt"),
        "--port",
        "0",
        "--log-level",
        "WARNING",
    ]
    if args.model:
        command += ["--model", args.model]
    if args.load_format:
        command += ["--load-format", args.load_format]
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command + args.server_args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_terminate_with_parent
        )
    deadline = time.monotonic() + args.startup_timeout
    while (match := READY.search(log_path.read_text(errors="replace"))) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    return Server(process, match.group(1), match.group(2), log_path=log_path)


def _terminate_with_parent() -> None:
    """In the server's process before exec: SIGTERM (a drain) when this soak dies, even by SIGKILL."""
    import ctypes

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def describe_model(server: Server) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{server.base_url}/v1/models") as response:
        card = (await response.json())["data"][0]
    server.model_name, server.max_model_len = card["id"], card["max_model_len"]


def vocab_size_of(model: str | None) -> int:
    from zllm.model_files import resolve_model_dir

    return json.loads((Path(resolve_model_dir(model)) / "config.json").read_text())["vocab_size"]


def stop_server(server: Server) -> int | None:
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        return None


# ---- the run ----------------------------------------------------------------------------------------


async def soak(args, server: Server) -> dict:
    from zllm import AsyncClient

    await describe_model(server)
    vocab_size = vocab_size_of(args.model)
    tally, samples, state = Tally(), [], {"phase": "warmup"}
    state["tally"] = tally
    start = time.monotonic()
    async with AsyncClient(server.endpoint, timeout=args.request_timeout) as monitor:  # a busy CPU answers late
        pids = engine_processes(server)
        sampler = asyncio.create_task(sample_every(args.sample_interval, monitor, pids, start, state, samples))
        await run_plans(make_plans(args.warmup, 0, args, vocab_size, server.max_model_len), server, args, Tally())
        await asyncio.sleep(args.quiet_period)
        baseline = await take_sample(monitor, pids, start, "baseline", 0)
        state["phase"], load_start = "load", time.monotonic()
        plans = make_plans(args.num_requests, args.warmup, args, vocab_size, server.max_model_len)
        await run_plans(plans, server, args, tally, stop_at=load_start + args.max_load_s)
        load_s = time.monotonic() - load_start
        state["phase"] = "quiet"
        await asyncio.sleep(args.quiet_period)
        final = await take_sample(monitor, pids, start, "final", tally.completed)
        sampler.cancel()
    return report(args, server, samples, baseline, final, tally, load_s)


def report(args, server: Server, samples, baseline: Sample, final: Sample, tally: Tally, load_s: float) -> dict:
    checks = check(baseline, final, tally, args)
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": server.model_name,
        "max_model_len": server.max_model_len,
        "num_requests": tally.completed,
        "planned_requests": args.num_requests,
        "concurrency": args.concurrency,
        "load_s": round(load_s, 1),
        "requests_per_s": round(tally.completed / load_s, 2),
        "outcomes": {" ".join(key): count for key, count in sorted(tally.outcomes.items())},
        "unexpected": tally.unexpected,
        "baseline": asdict(baseline),
        "final": asdict(final),
        "bounds": growth_bounds(args),
        "checks": checks,
        "ok": all(c["ok"] for c in checks),
        "samples": [asdict(sample) for sample in samples],
    }


def plot(path: str, result: dict) -> None:
    try:
        import matplotlib
    except ImportError:  # a plot is a convenience: the checks and the JSON stand without it
        print(
            f"matplotlib is not installed: no plot at {path} (pip install matplotlib; --plot-from redraws it)",
            file=sys.stderr,
        )
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"] + [result["final"]]
    times = [s["t"] for s in samples]
    figure, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    baseline = result["baseline"]["processes"]
    for name, before in baseline.items():  # growth, so that a leak shows on a 2 GB worker as on a 30 MB core
        axes[0][0].plot(times, [s["processes"][name]["rss_mib"] - before["rss_mib"] for s in samples], label=name)
    axes[0][0].set(ylabel="MiB", title=f"RSS minus the baseline (bound {result['bounds']['rss_mib']} MiB)")
    for axis, metric, label in ((axes[0][1], "fds", "open fds"), (axes[1][0], "threads", "threads")):
        for name in baseline:
            axis.plot(times, [s["processes"][name][metric] for s in samples], label=name)
        axis.set(ylabel=label, title=label + " per process")
    axes[0][0].legend(fontsize=8)
    engine = axes[1][1]
    engine.plot(times, [s["engine"]["num_free_kv_blocks"] for s in samples], label="free KV blocks")
    engine.plot(times, [s["engine"]["num_kv_blocks"] for s in samples], "--", label="all KV blocks")
    engine.set(ylabel="KV blocks", title="Engine")
    queues = engine.twinx()
    queues.plot(times, [s["engine"]["num_running"] for s in samples], color="tab:green", label="running")
    queues.plot(times, [s["engine"]["num_waiting"] for s in samples], color="tab:red", label="waiting")
    queues.set_ylabel("requests")
    engine.legend(loc="lower left", fontsize=8)
    queues.legend(loc="lower right", fontsize=8)
    for axis in (axes[1][0], axes[1][1]):
        axis.set_xlabel("time (s)")
    _shade_phases(axes, samples)
    figure.suptitle(
        f"soak: {result['num_requests']} requests at concurrency {result['concurrency']} "
        f"({result['model']}), {result['requests_per_s']} req/s; checks {'pass' if result['ok'] else 'FAIL'}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def _shade_phases(axes, samples: list[dict]) -> None:
    load = [s["t"] for s in samples if s["phase"] == "load"]
    if load:
        for axis in (a for row in axes for a in row):
            axis.axvspan(min(load), max(load), color="0.92", zorder=0)


def main() -> None:
    args = parse_args()
    if args.plot_from:  # draw a finished run again
        plot(args.plot, json.loads(Path(args.plot_from).read_text()))
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stop the server on the way out
    workdir = Path(tempfile.mkdtemp(prefix="zllm-soak-"))
    server = start_server(args, workdir)
    try:
        result = asyncio.run(soak(args, server))
    finally:
        exit_code = stop_server(server)
        shutil.rmtree(workdir, ignore_errors=True)
    result["checks"].append(_check("the server drains and exits on SIGTERM with code", exit_code, 0, exit_code == 0))
    result["ok"] = all(c["ok"] for c in result["checks"])
    summary = {key: result[key] for key in ("num_requests", "load_s", "requests_per_s", "ok")}
    print(json.dumps({**summary, "failed_checks": [c for c in result["checks"] if not c["ok"]]}))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(args.plot, result)
    sys.exit(0 if result["ok"] else 1)


def parse_args() -> argparse.Namespace:
    from zllm.config import LOAD_FORMATS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--load-format", default=None, choices=LOAD_FORMATS)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=200, help="requests before the baseline is taken")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", default="4:64", help="prompt tokens, LOW:HIGH")
    parser.add_argument("--output-len", default="1:16", help="max_tokens, LOW:HIGH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--quiet-period", type=float, default=10.0, help="seconds of no load before measuring")
    parser.add_argument(
        "--max-load-s",
        type=float,
        default=math.inf,
        help="start no request after this many seconds of load (a bounded run reports what it sent)",
    )
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0, help="per process, baseline to end")
    parser.add_argument("--max-fd-growth", type=int, default=8, help="per process, baseline to end")
    parser.add_argument("--max-thread-growth", type=int, default=4, help="per process, baseline to end")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--plot-from", default=None, metavar="JSON", help="only draw --plot from this run's --json")
    parser.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: flags for vllm-launch")
    args = parser.parse_args()
    args.server_args = [a for a in args.server_args if a != "--"]
    return args


if __name__ == "__main__":
    main()
