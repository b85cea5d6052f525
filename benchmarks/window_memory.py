"""KV memory of sliding-window models: window-aware blocks (zllm/kv_layout.py) against keeping
every block, and how many long sequences fit at once. For an MLA model (DeepSeek) the same report
of its latent cache, beside what per-head K and V caches of the same model would take (computed:
heads x (qk_head_dim + v_head_dim) values a token a layer) and how many sequences those would fit.

    python benchmarks/dummy_model.py deepseek-v2-lite /tmp/deepseek-v2-lite
    python benchmarks/window_memory.py --model /tmp/deepseek-v2-lite --max-model-len 8192

    python benchmarks/dummy_model.py gemma3-12b /tmp/gemma3-12b
    python benchmarks/window_memory.py --model /tmp/gemma3-12b --max-model-len 32768
    python benchmarks/window_memory.py --model /tmp/gemma3-12b --max-model-len 32768 --disable-hybrid-kv-cache-manager

Starts the engine (dummy weights), prints the KV cache it profiled, its groups, the KV bytes one
sequence of max-model-len tokens holds (while decoding) and the engine's max concurrency at that
length; then, unless --no-run, submits that many sequences of max-model-len tokens (prompt of
max-model-len - output-len random tokens, ignore_eos) at once and reports how many ran at the
same time and whether any was preempted. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time

import torch

from zllm import LLMEngine, SamplingParams
from zllm.kv_layout import KVLayout, cache_bytes_per_token, cache_entry
from zllm.model_spec import ModelSpec
from zllm.workers.model_runner import resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--max-model-len", type=int, default=32768)
    # Long enough that the first sequence still decodes when the last one's prefill is done.
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true")
    parser.add_argument("--num-seqs", type=int, default=None, help="default: the engine's max concurrency")
    parser.add_argument("--no-run", action="store_true")
    args = parser.parse_args()

    engine = LLMEngine.from_engine_args(
        args.model,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
        enable_prefix_caching=False,
    )
    try:
        result = _describe(engine, args)
        if not args.no_run:
            result.update(_run(engine, args, args.num_seqs or math.floor(result["max_concurrency"])))
    finally:
        engine.shutdown()
    print(json.dumps(result))


def _describe(engine: LLMEngine, args) -> dict:
    core, config = engine.core, engine.core.config
    spec = ModelSpec.from_pretrained(args.model)
    layout = KVLayout.of(spec, config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kv_bytes = (
        1
        if config.kv_cache_dtype.startswith("fp8")
        else resolve_dtype(config.dtype, device, spec.checkpoint_dtype).itemsize
    )
    parts, heads, values = cache_entry(spec, spec.num_kv_heads // config.tensor_parallel_size)
    layer_block_bytes = parts * heads * values * kv_bytes * config.block_size
    per_sequence = sum(
        len(g.layers) * layout.steady_blocks(config.max_model_len, g.window) * layer_block_bytes for g in core.kv_groups
    )
    kv_cache_bytes = core.num_kv_blocks * spec.num_layers * layer_block_bytes
    mla = {}
    if spec.mla is not None:  # what the same model would hold with per-head K and V (computed)
        per_head_token = spec.num_layers * spec.num_heads * (spec.mla.qk_head_dim + spec.mla.v_head_dim) * kv_bytes
        per_head_token //= config.tensor_parallel_size
        mla = {
            "kv_bytes_per_token": cache_bytes_per_token(spec, heads, kv_bytes),
            "per_head_kv_bytes_per_token_computed": per_head_token,
            "per_head_max_concurrency_computed": kv_cache_bytes / (per_head_token * config.max_model_len),
        }
    return {
        "mode": "every block" if args.disable_hybrid_kv_cache_manager else "window-aware",
        "max_model_len": config.max_model_len,
        "num_kv_blocks": core.num_kv_blocks,
        "kv_cache_gib": kv_cache_bytes / 2**30,
        "groups": [{"layers": len(g.layers), "window": g.window, "blocks": g.num_blocks} for g in core.kv_groups],
        "kv_gib_per_sequence": per_sequence / 2**30,
        "max_concurrency": core.max_concurrency,
        **mla,
    }


def _run(engine: LLMEngine, args, num_seqs: int) -> dict:
    rng = random.Random(0)
    prompt_len = args.max_model_len - args.output_len
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    vocab = ModelSpec.from_pretrained(args.model).vocab_size
    for i in range(num_seqs):
        ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    scheduler = engine.core.scheduler
    most_running, finished, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
        most_running = max(most_running, len(scheduler.running))
    return {
        "sequences": num_seqs,
        "finished": finished,
        "most_running_at_once": most_running,
        "preemptions": scheduler.num_preemptions,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }


if __name__ == "__main__":
    main()
