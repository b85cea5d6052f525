"""Decode latency at batch 1: ms per output token after the first.

    python benchmarks/latency.py --model DIR --load-format dummy --input-len 128 --output-len 256

Runs one request of input-len random prompt tokens (ignore_eos) through `LLM.generate`,
`--iters` times after a warm-up, and also a 1-token run to measure the prefill (TTFT).
ms/token = (t(output_len) - t(1)) / (output_len - 1); reports the median over iterations.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from zllm.launch.args import parse_json_object, parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--quantization", "-q", default=None, help="fp8: FP8 weights, quantized while loading")
    parser.add_argument("--kv-cache-dtype", default="auto", help="fp8: an FP8 E4M3 KV cache")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="default: max(batch size, 8); vllm-launch's default is 256 (compare W2 with a served run at that)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="off: as a server run with --no-enable-prefix-caching (the repeated prompt then prefills every time)",
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--piecewise-cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill steps as piecewise CUDA graphs (default: the engine's, on with CUDA for dense models)",
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument(
        "--distributed-executor-backend",
        choices=("mp", "ray"),
        default="mp",
        help="tp ranks as worker processes (mp) or Ray actors (ray)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: the engine's (on with CUDA)",
    )
    parser.add_argument(
        "--custom-all-reduce-max-size",
        dest="custom_all_reduce_max_bytes",
        type=parse_size,
        default=None,
        help="GPU tp: symmetric-memory all-reduce up to this size (default: the engine's, 1MiB on one "
        "node's GPUs; 0: NCCL only)",
    )
    parser.add_argument(
        "--speculative-config",
        type=parse_json_object,
        default=None,
        help='speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
    )
    args = parser.parse_args()

    from zllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        piecewise_cuda_graphs=args.piecewise_cuda_graphs,
        max_num_seqs=args.max_num_seqs or max(args.batch_size, 8),
        enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tp,
        distributed_executor_backend=args.distributed_executor_backend,
        async_scheduling=args.async_scheduling,
        custom_all_reduce_max_bytes=args.custom_all_reduce_max_bytes,
        speculative_config=args.speculative_config,
    )
    vocab = llm.engine.processor.vocab_size
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]} for _ in range(args.batch_size)
    ]

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    timed(args.output_len)  # warm-up
    full = [timed(args.output_len) for _ in range(args.iters)]
    first = [timed(1) for _ in range(args.iters)]
    per_token_ms = (statistics.median(full) - statistics.median(first)) / (args.output_len - 1) * 1e3
    print(
        json.dumps(
            {
                "batch_size": args.batch_size,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "median_total_s": round(statistics.median(full), 4),
                "median_ttft_s": round(statistics.median(first), 4),
                "decode_ms_per_token": round(per_token_ms, 3),
                "enforce_eager": args.enforce_eager,
                "max_num_seqs": llm.engine.config.max_num_seqs,
                "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
                "enable_prefix_caching": args.enable_prefix_caching,
                "piecewise_cuda_graphs": llm.engine.config.piecewise_cuda_graphs,
                "async_scheduling": llm.engine.config.async_scheduling,
                "tp": args.tp,
                "distributed_executor_backend": args.distributed_executor_backend,
                "quantization": args.quantization,
                "kv_cache_dtype": args.kv_cache_dtype,
                "custom_all_reduce_max_bytes": llm.engine.config.custom_all_reduce_max_bytes,
            }
        )
    )


if __name__ == "__main__":
    main()
