"""Speculative decoding end to end: output tokens per second at batch 1, with and without a
speculative config, on two workloads of chat prompts:

- copy-heavy: the answer repeats, edits or continues text that is in the prompt (n-gram's case);
- chat: open questions, whose answers share little with the prompt.

Each prompt runs alone (batch 1), greedy, `--max-tokens` long, warmed up once; the figure is all
output tokens over all wall time. Both engines run in this one process, one after the other, with
async scheduling as resolved (on with CUDA) unless `--no-async-scheduling` turns it off for both,
or `--compare-sync` adds the speculative engine with synchronous steps beside it.
Prints one JSON line per (workload, engine) and the speedups.

    python benchmarks/spec_e2e.py --model /tmp/smol.gguf --compare-sync \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from zllm.launch.args import parse_json_object

PASSAGE = (
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls circled over the market, "
    "and the baker on Quay Street opened his shutters at six, as he had done for thirty years. By seven "
    "the square was full of carts, and the smell of bread and tar drifted up to the church on the hill."
)
COPY_HEAVY = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the following text, replacing 'harbour' with 'river' and changing nothing else:\n\n{PASSAGE}",
    "Continue this list up to 40, one number per line:\n1\n2\n3\n4\n5\n6\n7\n8",
    "Copy this code and add a docstring to the function:\n\n"
    "def total(prices, tax):\n    subtotal = sum(prices)\n    return subtotal + subtotal * tax\n",
]
CHAT = [
    "What are three good habits for learning a new language?",
    "Write a short poem about autumn rain.",
    "Explain in a few sentences why the sky is blue.",
    "Give me an idea for a weekend trip in the mountains.",
]


def tokens_per_second(llm, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    from zllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(messages[:1], params, use_tqdm=False)  # warm-up
    tokens, start = 0, time.perf_counter()
    for message in messages:  # batch 1: one request at a time
        tokens += len(llm.chat([message], params, use_tqdm=False)[0].outputs[0].token_ids)
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--speculative-config", type=parse_json_object, required=True)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--compare-sync", action="store_true", help="also run the speculative engine with synchronous steps"
    )
    args = parser.parse_args()

    import torch

    from zllm import LLM

    results: dict[tuple[str, str], float] = {}
    engines = [("plain", None, args.async_scheduling), ("speculative", args.speculative_config, args.async_scheduling)]
    if args.compare_sync:
        engines.append(("speculative-sync", args.speculative_config, False))
    for engine, speculative, async_scheduling in engines:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=2048,
            speculative_config=speculative,
            async_scheduling=async_scheduling,
        )
        for workload, prompts in (("copy-heavy", COPY_HEAVY), ("chat", CHAT)):
            rate, tokens = tokens_per_second(llm, prompts, args.max_tokens)
            results[workload, engine] = rate
            line = {
                "workload": workload,
                "engine": engine,
                "async_scheduling": llm.engine.config.async_scheduling,
                "tokens_per_s": round(rate, 1),
                "tokens": tokens,
            }
            print(json.dumps(line), flush=True)
        if speculative is not None:
            print(json.dumps({"stats": dataclasses.asdict(llm.engine.core.stats())}), flush=True)
        llm.shutdown()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    speedups = {
        f"{w} {e}": round(results[w, e] / results[w, "plain"], 3)
        for w in ("copy-heavy", "chat")
        for e, _, _ in engines[1:]
    }
    print(json.dumps({"device": device, "speculative_config": args.speculative_config, "speedup": speedups}))


if __name__ == "__main__":
    main()
