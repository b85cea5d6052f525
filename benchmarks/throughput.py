"""Offline throughput: N prompts of given input/output lengths through `LLM.generate`.

    python benchmarks/throughput.py --num-prompts 64 --input-len 16:256 --output-len 16:256
    python benchmarks/throughput.py ... --hf --hf-batch-size 1 --hf-batch-size 16

Lengths are fixed (`128`) or drawn uniformly from a range (`16:256`) with --seed. Prompts are
random token ids; generation ignores EOS so each request produces exactly its output length.
With --hf the same workload also runs through HF transformers' `generate` (greedy, padded
batches of the given sizes; only each prompt's own output length is counted).
Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from zllm.launch.args import parse_json_object


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def make_workload(num_prompts: int, input_len: str, output_len: str, vocab_size: int, seed: int):
    rng = random.Random(seed)
    in_lo, in_hi = parse_range(input_len)
    out_lo, out_hi = parse_range(output_len)
    prompts, outputs = [], []
    for _ in range(num_prompts):
        length = rng.randint(in_lo, in_hi)
        # Skip the low ids: in most vocabularies they are special tokens.
        prompts.append([rng.randrange(100, vocab_size) for _ in range(length)])
        outputs.append(rng.randint(out_lo, out_hi))
    return prompts, outputs


def report(name: str, elapsed: float, prompts: list[list[int]], outputs: list[int], **extra) -> dict:
    num_in, num_out = sum(len(p) for p in prompts), sum(outputs)
    result = {
        "engine": name,
        "num_prompts": len(prompts),
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "total_tokens_per_s": round((num_in + num_out) / elapsed, 1),
        "input_tokens": num_in,
        "output_tokens": num_out,
        **extra,
    }
    print(json.dumps(result), flush=True)
    return result


def run_zllm(args, prompts, outputs) -> dict:
    from zllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        device=args.device,
        load_format=args.load_format,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tp,
        data_parallel_size=args.dp,
        async_scheduling=args.async_scheduling,
        piecewise_cuda_graphs=args.piecewise_cuda_graphs,
        speculative_config=args.speculative_config,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=not args.no_detokenize)
        for n in outputs
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    results = llm.generate(requests, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    assert [len(r.outputs[0].token_ids) for r in results] == outputs
    return report(
        "zllm",
        elapsed,
        prompts,
        outputs,
        max_num_batched_tokens=llm.engine.config.max_num_batched_tokens,
        max_num_seqs=llm.engine.config.max_num_seqs,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        num_kv_blocks=llm.engine.core.num_kv_blocks,
        async_scheduling=llm.engine.config.async_scheduling,
        tp=args.tp,
        dp=args.dp,
        piecewise_cuda_graphs=llm.engine.config.piecewise_cuda_graphs,
    )


def run_hf(args, prompts, outputs, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from zllm.model_files import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=torch.float32).eval()
    pad = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch, lengths = prompts[first : first + batch_size], outputs[first : first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(lengths),
                min_new_tokens=max(lengths),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
    elapsed = time.perf_counter() - start
    return report("hf-transformers", elapsed, prompts, outputs, batch_size=batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="16:256")
    parser.add_argument("--output-len", default="16:256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--quantization", "-q", default=None, help="fp8: FP8 weights, quantized while loading")
    parser.add_argument("--kv-cache-dtype", default="auto", help="fp8: an FP8 E4M3 KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: LLM's (GPU 8192, CPU 2048)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: LLM's (GPU 512, CPU 256)")
    parser.add_argument("--hf", action="store_true", help="also run HF transformers generate")
    parser.add_argument("--hf-batch-size", type=int, action="append", default=None)
    parser.add_argument("--skip-zllm", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--no-detokenize", action="store_true", help="token ids only (dummy-weight runs)")
    parser.add_argument("--max-model-len", type=int, default=0)
    parser.add_argument(
        "--piecewise-cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill steps as piecewise CUDA graphs (default: the engine's, on with CUDA for dense models)",
    )
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument(
        "-dp",
        "--dp",
        "--data-parallel-size",
        dest="dp",
        type=int,
        default=1,
        help="engine-core processes, each with its own --tp GPUs",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: the engine's (on with CUDA)",
    )
    parser.add_argument(
        "--speculative-config",
        type=parse_json_object,
        default=None,
        help='speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
    )
    args = parser.parse_args()

    from transformers import AutoConfig

    from zllm.model_files import resolve_model_dir

    vocab_size = AutoConfig.from_pretrained(resolve_model_dir(args.model)).vocab_size
    prompts, outputs = make_workload(args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed)
    if not args.skip_zllm:
        run_zllm(args, prompts, outputs)
    if args.hf:
        for batch_size in args.hf_batch_size or [1]:
            run_hf(args, prompts, outputs, batch_size)


if __name__ == "__main__":
    main()
