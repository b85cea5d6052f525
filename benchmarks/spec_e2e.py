"""Speculative decoding end to end: output tokens per second at batch 1, with and without a
speculative config, on two workloads of chat prompts:

- copy-heavy: the answer repeats text that is in the prompt (n-gram's case): a 6-sentence
  paragraph, a letter, a short Python function and a JSON record, each to be repeated exactly.
  These are copy tasks that SmolLM2-135M-Instruct does (near) right; it does not do edits
  (rename, replace a word, fix typos, reformat: it answers an unchanged or broken copy) nor long
  code, so those are left out (docs/benchmarks.md shows its answers);
- chat: open questions, whose answers share little with the prompt.

Each prompt runs alone (batch 1), greedy, at most 256 tokens on copy-heavy (room for each copy)
and 160 on chat (or `--max-tokens` for both),
warmed up once; the figure is all output tokens over all wall time. The engines live in this one
process at once and take turns, `--rounds` times (3; each round in another order), and the
figures are each engine's median round, because a host-bound 135M model's tokens/s drifts by
about 10% between runs of one engine. Async scheduling as resolved (on with CUDA) unless
`--no-async-scheduling` turns it off for both, or `--compare-sync` adds the speculative engine
with synchronous steps beside it. Prints one JSON line per (workload, engine), with the engine
steps and, for a speculative engine, that workload's acceptance (drafts, accepted per position,
mean acceptance length), then the speedups. `--show-outputs` prints each answer and its own
acceptance, to check what the model did.

    python benchmarks/spec_e2e.py --model /tmp/smol.gguf --compare-sync \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from zllm.launch.args import parse_json_object

PASSAGE = (
    "The harbour town woke slowly. Fishing boats came in with the tide, gulls circled over the market, "
    "and the baker on Quay Street opened his shutters at six, as he had done for thirty years. By seven "
    "the square was full of carts, and the smell of bread and tar drifted up to the church on the hill. "
    "Children ran between the stalls, the fishmonger shouted the price of mackerel, and an old dog slept "
    "in the sun by the fountain. At noon the bell rang, the carts rolled away, and the square was quiet "
    "again until the evening, when the fishermen came back to mend their nets and talk about the weather."
)
LETTER = (
    "Dear Alice,\n\nThank you for your letter of the third of May. I am glad to hear that the new house is "
    "finished and that the garden is already full of roses. We will visit you in June, as we planned, and we "
    "will bring the books you asked for. Please tell Tom that his bicycle is repaired and waiting for him in "
    "our garage.\n\nWith love,\nMary"
)
FUNCTION = "def average(prices):\n    if not prices:\n        return 0.0\n    return sum(prices) / len(prices)\n"
RECORD = (
    '{"id": 1042, "name": "Alice Martin", "email": "alice.martin@example.com", "city": "London", '
    '"country": "United Kingdom", "orders": [{"item": "lamp", "price": 24.5}, {"item": "desk", "price": 180.0}], '
    '"active": true}'
)
COPY_HEAVY = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Repeat this letter exactly:\n\n{LETTER}",
    f"Repeat this code exactly:\n\n```python\n{FUNCTION}```",
    f"Repeat this JSON record exactly:\n\n{RECORD}",
]
CHAT = [
    "What are three good habits for learning a new language?",
    "Write a short poem about autumn rain.",
    "Explain in a few sentences why the sky is blue.",
    "Give me an idea for a weekend trip in the mountains.",
]


def acceptance(before, after, tokens: int) -> dict:
    """What the engine did between two `SchedulerStats`: its steps (prefills included) and, when it
    drafted, the drafts, the accepted tokens per position and the mean acceptance length (tokens a
    verifying step gains: 1 + accepted / drafts, vLLM's definition)."""
    steps = after.num_steps - before.num_steps
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    old = before.spec_decode_num_accepted_tokens_per_pos
    per_position = [
        n - (old[i] if i < len(old) else 0) for i, n in enumerate(after.spec_decode_num_accepted_tokens_per_pos)
    ]
    line = {"steps": steps, "tokens_per_step": round(tokens / steps, 2) if steps else 0.0}
    if draft_tokens:
        line |= {
            "drafts": drafts,
            "draft_tokens": draft_tokens,
            "accepted": accepted,
            "accepted_per_position": per_position,
            "acceptance_rate": round(accepted / draft_tokens, 3),
            "mean_acceptance_length": round(1 + accepted / drafts, 2),
        }
    return line


def run_workload(llm, prompts: list[str], max_tokens: int, show_outputs: bool) -> tuple[float, int, dict]:
    """Tokens per second over the prompts, one at a time, the token count and the engine's acceptance."""
    from zllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(messages[:1], params, use_tqdm=False)  # warm-up
    stats = llm.engine.core.stats
    first = stats()
    tokens, start = 0, time.perf_counter()
    for index, message in enumerate(messages):  # batch 1: one request at a time
        before = stats() if show_outputs else None
        output = llm.chat([message], params, use_tqdm=False)[0].outputs[0]
        tokens += len(output.token_ids)
        if show_outputs:
            line = {"prompt": index, "tokens": len(output.token_ids), "finish_reason": output.finish_reason}
            print(json.dumps(line | acceptance(before, stats(), len(output.token_ids))), flush=True)
            print(output.text, flush=True)
    rate = tokens / (time.perf_counter() - start)
    return rate, tokens, acceptance(first, stats(), tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="for every workload (default: copy-heavy 256, chat 160)"
    )
    parser.add_argument("--speculative-config", type=parse_json_object, required=True)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument(
        "--compare-sync", action="store_true", help="also run the speculative engine with synchronous steps"
    )
    parser.add_argument(
        "--compare-adaptive",
        action="store_true",
        help="also run the speculative engine with adaptive n-gram draft lengths (ZLLM_NGRAM_ADAPTIVE=1)",
    )
    parser.add_argument("--no-plain", action="store_true", help="run only the speculative engine(s)")
    parser.add_argument("--workloads", default="copy-heavy,chat", help="comma-separated: copy-heavy, chat")
    parser.add_argument("--show-outputs", action="store_true", help="print each answer and its acceptance")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over every engine, all alive at once, each round in another order; the figures are "
        "the medians (a host-bound 135M model's tokens/s drifts by 10%% between runs of one engine)",
    )
    args = parser.parse_args()

    import torch

    from zllm import LLM

    workloads = {"copy-heavy": COPY_HEAVY, "chat": CHAT}
    adaptive = os.environ.get("ZLLM_NGRAM_ADAPTIVE", "0")
    # Copy-heavy: room for the longest copy (about 140 tokens); chat: as long as it always was.
    max_tokens = {"copy-heavy": 256, "chat": 160}
    chosen = args.workloads.split(",")
    kinds = [("speculative", args.speculative_config, args.async_scheduling)]
    if not args.no_plain:
        kinds.insert(0, ("plain", None, args.async_scheduling))
    if args.compare_sync:
        kinds.append(("speculative-sync", args.speculative_config, False))
    if args.compare_adaptive:
        kinds.append(("speculative-adaptive", args.speculative_config, args.async_scheduling))
    share = round(0.9 / len(kinds), 2)  # every engine's KV cache in one GPU at once
    engines = {}
    for name, speculative, async_scheduling in kinds:
        # The proposer reads ZLLM_NGRAM_ADAPTIVE when its engine starts.
        os.environ["ZLLM_NGRAM_ADAPTIVE"] = "1" if name == "speculative-adaptive" else adaptive
        engines[name] = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=2048,
            speculative_config=speculative,
            async_scheduling=async_scheduling,
            gpu_memory_utilization=share,
        )
    os.environ["ZLLM_NGRAM_ADAPTIVE"] = adaptive
    rates: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        names = list(engines)
        names = names[round_index % len(names) :] + names[: round_index % len(names)]  # rotate the order
        for name in names:
            llm = engines[name]
            for workload in chosen:
                rate, tokens, steps = run_workload(
                    llm, workloads[workload], args.max_tokens or max_tokens[workload], args.show_outputs
                )
                rates.setdefault((workload, name), []).append(rate)
                line = {
                    "round": round_index,
                    "workload": workload,
                    "engine": name,
                    "async_scheduling": llm.engine.config.async_scheduling,
                    "tokens_per_s": round(rate, 1),
                    "tokens": tokens,
                }
                print(json.dumps(line | steps), flush=True)
    for llm in engines.values():
        llm.shutdown()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    medians = {key: statistics.median(values) for key, values in rates.items()}
    speedups = {
        f"{w} {e}": round(medians[w, e] / medians[w, "plain"], 3)
        for w in chosen
        for e in engines
        if e != "plain" and (w, "plain") in medians
    }
    per_round = {
        f"{w} {e}": [round(a / b, 3) for a, b in zip(rates[w, e], rates[w, "plain"])]
        for w in chosen
        for e in engines
        if e != "plain" and (w, "plain") in rates
    }
    print(
        json.dumps(
            {
                "device": device,
                "speculative_config": args.speculative_config,
                "rounds": args.rounds,
                "median_tokens_per_s": {f"{w} {e}": round(v, 1) for (w, e), v in medians.items()},
                "speedup": speedups,
                "speedup_per_round": per_round,
            }
        )
    )


if __name__ == "__main__":
    main()
