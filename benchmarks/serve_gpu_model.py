"""Issue 40's served rate sweep, modelled: the real scheduler under Poisson arrivals, in virtual time.

    python benchmarks/serve_gpu_model.py [--rates 8 16 24 32 40] [--max-num-batched-tokens 2048 ...]

A CPU model, not a GPU measurement. Each rate's requests arrive as vLLM 0.6.3's
benchmark_serving.py sends them (its numpy draws with seed = the rate, as run_perf.sh's sweep
passes it: the same 256-token prompts and the same Poisson gaps as the measured runs). They go
through zllm's Scheduler at the serving defaults (vllm-launch: max_num_seqs 256, budget 2048,
prefix caching on, async scheduling), driven as EngineCore drives it: two steps in flight, the
core adds what arrived only when it returns from collecting a step, so a request that arrives
while step k runs is scheduled into step k+2, which starts when k+1 ends. Each step's device
time comes from StepCost (below: every constant is an argument, each derived in its comment);
a token is out when its step ends. The tokens are fabricated; frontend, HTTP and client cost
nothing unless --ingress-ms / --egress-ms say otherwise; --stall-ms freezes the host once per
--stall-period-s (what a GC pause would do). Prints a JSON line per rate (TTFT and ITL as vLLM's
client computes them) and, with --table, the markdown table of docs/benchmarks.md.

    python benchmarks/serve_gpu_model.py --trace PREFIX      (a served run's ZLLM_STEP_TRACE)

compares a GPU run's engine-core trace with the model instead, step by step (compare_trace).
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np

from benchmarks.dp_gpu_model import build_scheduler, sampling_ids
from benchmarks.step_trace_summary import last_batch, load
from zllm.enginecore.request import Request
from zllm.enginecore.scheduler import Scheduler
from zllm.ipc.messages import StepInput, StepOutput
from zllm.sampling_params import SamplingParams

PROMPTS_PER_RATE = {8: 300, 16: 480}  # run_perf.sh's sweep; every other rate sends 600
VOCAB = 128256  # the dummy Llama-3-8B's placeholder tokenizer: its vocab_size drives the client's draws


@dataclass(slots=True)
class StepCost:
    """One step's device time (ms) on the H100, Llama-3-8B shape, bf16, from docs/benchmarks.md.

    GEMMs over the step's T token rows: max(memory-bound, compute-bound line). The compute line
    goes through the batch-256 and batch-512 decode profiles' GEMM time (6.95 and 10.32 ms,
    issue 20); extended to a W1 mixed step of 7,495 tokens it gives ~102 ms, where the packed
    prefill's step measured ~110. The memory-bound line starts at cuBLAS's batch-1 GEMVs (5.65
    ms, issue 10) and meets the other at 256 rows. Decode attention reads every decode row's
    context: 6.27 + 0.19 ms for 256 rows of ~400 tokens (issue 20) is 6.3e-5 ms per context
    token. rest_row_ms: norms, rotary, sampling per row (0.88 ms at 256 rows, 0.3 at 1). A step
    with any prefill runs the piecewise graphs with attention eager between them: +2.9 ms (a
    5-token step cost 9.81 ms against 6.42 for the decode graph's 1-token step, less 0.46 ms
    of cuBLAS over the GEMV; issue 39), and the packed prefill attention ~0.8 µs per prefill
    token (32 layers, issue 20 step 1; launches counted in the 2.9 ms). base_ms is everything
    else of a served decode step: calibrated so that the model's median ITL at 8 req/s equals
    the measured 7.37 ms (the offline batch-1 step's leftovers are ~0.75 ms; serving adds ~0.5).
    Assumed: no padding to the pieces' captured sizes, lm_head counted for prefill rows too.
    """

    base_ms: float = 1.21
    gemm_mem_ms: float = 5.65
    gemm_mem_row_ms: float = 0.0051
    gemm_flop_ms: float = 3.58
    gemm_flop_row_ms: float = 0.01316
    decode_ctx_ms: float = 6.3e-5
    rest_row_ms: float = 0.0023
    piecewise_ms: float = 2.9
    prefill_token_ms: float = 0.0008

    def ms(self, step: StepInput, scheduler: Scheduler) -> float:
        decodes = [rid for rid, n in zip(step.scheduled_ids, step.num_scheduled_tokens) if n == 1]
        context = sum(scheduler.requests[rid].num_computed_tokens for rid in decodes if rid in scheduler.requests)
        return self.of(len(step.scheduled_ids), step.total_num_scheduled_tokens, len(decodes), context)

    def of(self, reqs: int, tokens: int, decodes: int, context: int) -> float:
        """A step of `reqs` requests and `tokens` tokens, `decodes` of them one-token rows that
        attend over `context` tokens in all."""
        gemm = max(self.gemm_mem_ms + self.gemm_mem_row_ms * tokens, self.gemm_flop_ms + self.gemm_flop_row_ms * tokens)
        cost = self.base_ms + gemm + self.decode_ctx_ms * context + self.rest_row_ms * reqs
        if tokens > decodes:
            cost += self.piecewise_ms + self.prefill_token_ms * (tokens - decodes)
        return cost


@dataclass(slots=True)
class Arrival:
    time_s: float
    prompt: list[int]
    output_len: int


def client_arrivals(seed: int, rate: float, num_prompts: int, input_len: int, output_len: int) -> list[Arrival]:
    """What benchmark_serving.py 0.6.3 sends for `--dataset-name random --seed SEED`: its numpy
    draws in its order (prefix, input lengths, output lengths, offsets, then one exponential gap
    after each request), so the prompts and the Poisson gaps are the measured runs' own."""
    rng = np.random.RandomState(seed)
    rng.randint(0, VOCAB, size=0)  # --random-prefix-len 0
    input_lens = rng.randint(input_len, input_len + 1, size=num_prompts)
    output_lens = rng.randint(output_len, output_len + 1, size=num_prompts)
    offsets = rng.randint(0, VOCAB, size=num_prompts)
    arrivals, now = [], 0.0
    for i in range(num_prompts):
        prompt = [int(offsets[i] + i + j) % VOCAB for j in range(input_lens[i])]
        arrivals.append(Arrival(now, prompt, int(output_lens[i])))
        now += rng.exponential(1.0 / rate)
    return arrivals


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    scheduled: float = -1.0  # when the core first put it in a step
    started: float = -1.0  # when that step began on the device
    tokens: list[float] = field(default_factory=list)


@dataclass(slots=True)
class StepRecord:
    scheduled: float
    start: float
    end: float
    reqs: int
    tokens: int
    prefill_tokens: int
    waiting: int


class VirtualEngine:
    """EngineCore's busy loop (zllm/enginecore/process.py + core.py) over a virtual device."""

    def __init__(
        self, scheduler: Scheduler, cost: StepCost, depth: int, host_ms: float, stall: tuple[float, float] = (0.0, 0.0)
    ) -> None:
        self.scheduler, self.cost, self.depth, self.host_s = scheduler, cost, depth, host_ms / 1000
        self.now = self.device_free = 0.0
        # (seconds, period): the host freezes that long once a period (e.g. a GC pause), first
        # half a period in; the device finishes what it holds and then idles.
        self.stall_s, self.stall_period_s = stall
        self.next_stall = self.stall_period_s / 2 if self.stall_s else float("inf")
        self.in_flight: deque[tuple[StepInput, list[str], float]] = deque()
        self.times: dict[str, RequestTimes] = {}
        self.steps: list[StepRecord] = []

    def run(self, arrivals: list[Arrival], ingress_s: float, ignore_eos: bool = True) -> None:
        queue = deque(enumerate(sorted(arrivals, key=lambda a: a.time_s)))
        for index, arrival in queue:
            self.times[str(index)] = RequestTimes(arrival.time_s)
        while queue or self.scheduler.has_unfinished_requests() or self.in_flight:
            if self.now >= self.next_stall:
                self.now, self.next_stall = self.now + self.stall_s, self.next_stall + self.stall_period_s
            while queue and queue[0][1].time_s + ingress_s <= self.now:
                index, arrival = queue.popleft()
                params = SamplingParams(temperature=0.0, max_tokens=arrival.output_len, ignore_eos=ignore_eos)
                self.scheduler.add_request(Request(str(index), arrival.prompt, params, arrival_time=arrival.time_s))
            if not self.scheduler.has_unfinished_requests() and not self.in_flight:
                self.now = queue[0][1].time_s + ingress_s  # idle: the core blocks on its input queue
                continue
            if len(self.in_flight) < self.depth and self._submit() and len(self.in_flight) < self.depth:
                continue  # the pipeline has room: back to the inputs, then schedule the next one
            if not self.in_flight:
                raise RuntimeError("requests left that no step can take")
            self._collect()

    def _submit(self) -> bool:
        step = self.scheduler.schedule()
        if step.is_empty:
            return False
        start = max(self.now + self.host_s, self.device_free)
        end = self.device_free = start + self.cost.ms(step, self.scheduler) / 1000
        for request_id in step.scheduled_ids:
            times = self.times[request_id]
            if times.scheduled < 0:
                times.scheduled, times.started = self.now, start
        decodes = sum(1 for n in step.num_scheduled_tokens if n == 1)
        self.steps.append(
            StepRecord(
                self.now,
                start,
                end,
                len(step.scheduled_ids),
                step.total_num_scheduled_tokens,
                step.total_num_scheduled_tokens - decodes,
                len(self.scheduler.waiting),
            )
        )
        self.in_flight.append((step, sampling_ids(self.scheduler, step), end))
        return True

    def _collect(self) -> None:
        step, sampled, end = self.in_flight.popleft()
        self.now = max(self.now, end)
        deltas = self.scheduler.update_from_output(StepOutput(step.step_id, sampled, [7] * len(sampled)))
        for delta in deltas:
            self.times[delta.request_id].tokens.extend([end] * len(delta.new_token_ids))


def summarize(engine: VirtualEngine, egress_s: float) -> dict:
    """TTFT and ITL as vLLM 0.6.3's client computes them (ms; ITLs of every request pooled)."""
    done = [t for t in engine.times.values() if t.tokens]
    ttft = np.array([t.tokens[0] + egress_s - t.arrival for t in done]) * 1000
    itl = np.concatenate([np.diff(t.tokens) for t in done]) * 1000
    first, last = min(t.arrival for t in done), max(t.tokens[-1] for t in done)
    steps = engine.steps
    costs = np.array([s.end - s.start for s in steps]) * 1000
    mixed = np.array([s.prefill_tokens > 0 for s in steps])
    return {
        "completed": len(done),
        "req_s": round(len(done) / (last + egress_s - first), 2),
        "ttft_ms": _percentiles(ttft),
        "itl_ms": _percentiles(itl),
        "steps": len(steps),
        "mixed_steps": int(mixed.sum()),
        "decode_step_ms_median": round(float(np.median(costs[~mixed])), 2) if (~mixed).any() else None,
        "mixed_step_ms_median": round(float(np.median(costs[mixed])), 2) if mixed.any() else None,
        "step_ms_max": round(float(costs.max()), 2),
        "mean_batch": round(float(np.mean([s.reqs for s in steps])), 1),
        "max_batch": max(s.reqs for s in steps),
        "max_waiting": max(s.waiting for s in steps),
        "ttft_parts_p99_ms": ttft_parts(done, ttft),
        "preemptions": engine.scheduler.num_preemptions,
    }


def ttft_parts(done: list[RequestTimes], ttft: np.ndarray) -> dict:
    """Where the slowest 1% of first tokens spent their time (means over them, ms): until the
    core first scheduled them (the step it was collecting, or no room in the budget), until
    that step began on the device (the step in flight ahead of it: async's lag), until the
    first token (their prefill's steps, chunks included)."""
    slow = [t for t, v in zip(done, ttft) if v >= np.percentile(ttft, 99)]
    return {
        "to_scheduled": round(1000 * float(np.mean([t.scheduled - t.arrival for t in slow])), 1),
        "to_device": round(1000 * float(np.mean([t.started - t.scheduled for t in slow])), 1),
        "to_first_token": round(1000 * float(np.mean([t.tokens[0] - t.started for t in slow])), 1),
    }


def _percentiles(values: np.ndarray) -> dict:
    return {
        "median": round(float(np.median(values)), 2),
        "mean": round(float(np.mean(values)), 2),
        "p99": round(float(np.percentile(values, 99)), 2),
    }


def model_rate(args, rate: float, cost: StepCost) -> dict:
    num_prompts = args.num_prompts or PROMPTS_PER_RATE.get(int(rate), 600)
    arrivals = client_arrivals(
        int(rate) if args.seed is None else args.seed, rate, num_prompts, args.input_len, args.output_len
    )
    scheduler = build_scheduler(args, async_scheduling=not args.sync, prefix_caching=True)
    stall = (args.stall_ms / 1000, args.stall_period_s)
    engine = VirtualEngine(scheduler, cost, 1 if args.sync else 2, args.host_ms, stall)
    engine.run(arrivals, args.ingress_ms / 1000)
    return {"rate": rate, "requests": num_prompts, **summarize(engine, args.egress_ms / 1000)}


def compare_trace(prefix: str, cost: StepCost, mean_context: int) -> dict:
    """A served run's engine-core trace (ZLLM_STEP_TRACE=PREFIX, its last busy stretch) against
    the model, step by step. Under async scheduling each step() call submits one step and
    collects the one before; the time between two calls' ends is the device time of the step
    collected in the second (the device never idles while requests run), submitted by the first.
    A decode row's context is not traced: every one is taken as `mean_context` tokens."""
    lines = last_batch(load(prefix, r"dp0")["dp0"])
    pairs = [(a, b["t"] - a["t"]) for a, b in zip(lines, lines[1:]) if "reqs" in a and b["collected"]]
    rows = {"decode": ([], []), "mixed": ([], [])}
    for line, period in pairs:
        decodes = line["tokens"] - line["prefill_tokens"]
        modelled = cost.of(line["reqs"], line["tokens"], decodes, decodes * mean_context)
        measured, model = rows["mixed" if line["prefill_tokens"] else "decode"]
        measured.append(period * 1000)
        model.append(modelled)
    stalls = sorted((round(p * 1000, 1) for _, p in pairs if p > 0.1), reverse=True)
    return {
        **{
            kind: {"steps": len(m), "measured_ms": _percentiles(np.array(m)), "model_ms": _percentiles(np.array(c))}
            for kind, (m, c) in rows.items()
            if m
        },
        "periods_over_100ms": stalls[:20],
        "longest_core_call_ms": round(1000 * max(line["busy_s"] for line in lines), 1),
        "longest_core_gap_ms": round(1000 * max(line["gap_s"] for line in lines), 1),
        "most_waiting": max(line["waiting"] for line in lines),
        "most_running": max(line["running"] for line in lines),
    }


def cost_from_args(args) -> StepCost:
    return StepCost(**{f.name: getattr(args, f.name) for f in fields(StepCost)})


def print_table(rows: list[dict]) -> None:
    print("| rate (req/s) | completed | req/s | TTFT median / p99 (ms) | ITL median / mean / p99 (ms) |")
    print("|---:|---:|---:|---|---|")
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(
            f"| {r['rate']:g} | {r['completed']}/{r['requests']} | {r['req_s']} | {t['median']} / {t['p99']} | "
            f"{i['median']} / {i['mean']} / {i['p99']} |"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[8, 16, 24, 32, 40])
    parser.add_argument("--num-prompts", type=int, default=0, help="0: the sweep's (300, 480, then 600)")
    parser.add_argument("--seed", type=int, default=None, help="the client's seed; default: the rate, as the sweep")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=28033, help="the H100's at --max-model-len 1024 (issue 20)")
    parser.add_argument("--sync", action="store_true", help="no async scheduling: one step in flight")
    parser.add_argument("--host-ms", type=float, default=0.0, help="host time from a collect to the next submit")
    parser.add_argument("--ingress-ms", type=float, default=0.0, help="client to engine core, per request")
    parser.add_argument("--stall-ms", type=float, default=0.0, help="a host freeze (GC, ...) of this long ...")
    parser.add_argument("--stall-period-s", type=float, default=5.0, help="... once per this period")
    parser.add_argument("--egress-ms", type=float, default=0.0, help="a step's end to the client's token")
    for f in fields(StepCost):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default)
    parser.add_argument("--table", action="store_true", help="also print the markdown table")
    parser.add_argument("--trace", help="compare a served run's ZLLM_STEP_TRACE prefix with the model instead")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    cost = cost_from_args(args)
    if args.trace:
        print(json.dumps(compare_trace(args.trace, cost, args.input_len + args.output_len // 2)))
        return
    rows = [model_rate(args, rate, cost) for rate in args.rates]
    for row in rows:
        print(json.dumps(row))
    if args.table:
        print_table(rows)


if __name__ == "__main__":
    main()
