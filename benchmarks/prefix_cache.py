"""Prefix caching on vs off: many requests sharing a long system prompt.

    python benchmarks/prefix_cache.py --num-requests 32 --system-len 1024 --question-len 16 --output-len 16
    python benchmarks/prefix_cache.py ... --request-rate 2   # arrivals spread over time (Poisson-free: evenly)

Each request is the same system prompt (real text, cut to --system-len tokens) followed by its own
random question tokens; generation is greedy with ignore_eos, so every request produces exactly
--output-len tokens. The same workload runs through an in-process `LLMEngine` with prefix caching
on, then off (a fresh engine each). TTFT is measured per request from its arrival to the step
that returned its first token. Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

_TEXT = (
    "You are the support assistant of a regional train operator. Answer politely and precisely. "
    "Tickets can be changed until departure; refunds are possible up to 24 hours before travel. "
    "Bicycles travel free outside rush hours. Children under six travel free with an adult. "
)


def make_workload(tokenizer, num_requests: int, system_len: int, question_len: int, seed: int) -> list[list[int]]:
    system = tokenizer.encode(_TEXT * (system_len // 40 + 2), add_special_tokens=False)[:system_len]
    assert len(system) == system_len, f"system prompt has only {len(system)} tokens"
    rng = random.Random(seed)
    vocab = len(tokenizer)
    return [system + [rng.randrange(100, vocab) for _ in range(question_len)] for _ in range(num_requests)]


def run(args, prompts: list[list[int]], caching: bool) -> dict:
    from zllm import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(
        args.model,
        dtype=args.dtype,
        device=args.device,
        enable_prefix_caching=caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    _drain(engine, [("warmup", [5, 6, 7])], SamplingParams(max_tokens=2, detokenize=False))
    engine.reset_prefix_cache()
    before = engine.core.stats()

    interval = 0.0 if args.request_rate is None else 1.0 / args.request_rate
    pending = [(f"r{i}", ids) for i, ids in enumerate(prompts)]
    arrival: dict[str, float] = {}
    first_token: dict[str, float] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and now - start >= len(arrival) * interval:
            request_id, ids = pending.pop(0)
            arrival[request_id] = now
            engine.add_request(request_id, {"prompt_token_ids": ids}, params)
        for output in engine.step():
            if output.request_id not in first_token and output.outputs[0].token_ids:
                first_token[output.request_id] = time.perf_counter()
        if not engine.has_unfinished_requests() and pending:
            time.sleep(max(0.0, start + len(arrival) * interval - time.perf_counter()))
    elapsed = time.perf_counter() - start

    stats = engine.core.stats()
    ttft = sorted(first_token[r] - arrival[r] for r in arrival)
    num_in, num_out = sum(map(len, prompts)), len(prompts) * args.output_len
    result = {
        "prefix_caching": caching,
        "num_requests": len(prompts),
        "system_len": args.system_len,
        "question_len": args.question_len,
        "output_len": args.output_len,
        "request_rate": args.request_rate,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "total_tokens_per_s": round((num_in + num_out) / elapsed, 1),
        "ttft_mean_s": round(statistics.fmean(ttft), 3),
        "ttft_median_s": round(statistics.median(ttft), 3),
        "ttft_p90_s": round(ttft[int(0.9 * (len(ttft) - 1))], 3),
        "prefix_cache_hit_rate": round(
            (stats.prefix_cache_hits - before.prefix_cache_hits)
            / max(1, stats.prefix_cache_queries - before.prefix_cache_queries),
            3,
        ),
    }
    print(json.dumps(result), flush=True)
    engine.shutdown()
    return result


def _drain(engine, requests, params) -> None:
    for request_id, ids in requests:
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=None, help="requests per second (default: all at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--modes", default="on,off", help="which runs, in order: on, off or both")
    args = parser.parse_args()

    from zllm.frontend.tokenizer import load_tokenizer
    from zllm.model_files import resolve_model_dir

    args.model = str(resolve_model_dir(args.model))
    prompts = make_workload(
        load_tokenizer(args.model), args.num_requests, args.system_len, args.question_len, args.seed
    )
    results = {mode: run(args, prompts, mode == "on") for mode in args.modes.split(",")}
    if set(results) == {"on", "off"}:
        on, off = results["on"], results["off"]
        print(
            json.dumps(
                {
                    "speedup_total_tokens_per_s": round(on["total_tokens_per_s"] / off["total_tokens_per_s"], 2),
                    "ttft_mean_ratio_off_over_on": round(off["ttft_mean_s"] / on["ttft_mean_s"], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
