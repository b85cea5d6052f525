"""How often tensor-parallel greedy decoding picks the same tokens as tp 1.

    python benchmarks/tp_agreement.py --model DIR --load-format dummy --tp 2 --dtype bfloat16
    python benchmarks/tp_agreement.py --model DIR --load-format dummy --tp 2 --dp 2 --dtype float32 --require-equal
    python benchmarks/tp_agreement.py --model DIR --load-format dummy --tp 2 --reference-tp 2 \
        --distributed-executor-backend ray --dtype float32 --require-equal   # Ray's ranks against mp's

Runs the same random prompts greedily at tp 1 and at tp N (one after the other, in this process
and its worker processes; with --dp M, as M data-parallel engines of tp N each, the requests
spread over them) and reports, as JSON: the share of output positions whose tokens agree, the
share of requests that agree entirely, and the mean position of the first disagreement. With
--require-equal it exits 1 unless every request agrees entirely (fp32: expected).
In bf16 the all-reduce sums partial products in a different order than one GPU does, so
near-ties can flip; once one token differs, the rest of that sequence follows another path.
Dummy weights are the same model at every tp (see zllm/workers/weight_loader.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import random


def greedy_tokens(args, tp: int, prompts: list[list[int]], dp: int = 1, backend: str = "mp") -> list[list[int]]:
    from zllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        distributed_executor_backend=backend,
        max_model_len=args.max_model_len,
        max_num_seqs=max(len(prompts), 8),
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.shutdown()
        gc.collect()


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    same_positions = sum(a == b for ref, got in zip(reference, other) for a, b in zip(ref, got))
    total = sum(len(ref) for ref in reference)
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref)) for ref, got in zip(reference, other)
    ]
    return {
        "identical_token_share": round(same_positions / total, 4),
        "identical_request_share": round(sum(a == b for a, b in zip(reference, other)) / len(reference), 4),
        "mean_first_difference": round(sum(first_diff) / len(first_diff), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel engines of --tp ranks each")
    parser.add_argument("--require-equal", action="store_true", help="exit 1 unless every request equals tp 1's")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--distributed-executor-backend",
        choices=("mp", "ray"),
        default="mp",
        help="how the --tp ranks run: worker processes (mp) or Ray actors (ray); the reference is always mp",
    )
    parser.add_argument(
        "--reference-tp", type=int, default=1, help="the reference's tp (e.g. 2: Ray's tp 2 against mp's)"
    )
    args = parser.parse_args()

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    reference = greedy_tokens(args, args.reference_tp, prompts)
    other = greedy_tokens(args, args.tp, prompts, dp=args.dp, backend=args.distributed_executor_backend)
    result = {
        "benchmark": "tp_agreement",
        "tp": args.tp,
        "dp": args.dp,
        "distributed_executor_backend": args.distributed_executor_backend,
        "reference_tp": args.reference_tp,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        **compare(reference, other),
    }
    print(json.dumps(result), flush=True)
    if args.require_equal and result["identical_request_share"] != 1.0:
        raise SystemExit(
            f"tp {args.tp} x dp {args.dp} ({args.distributed_executor_backend}): not every request equals "
            f"tp {args.reference_tp}'s"
        )


if __name__ == "__main__":
    main()
