"""The real SmolLM2-135M-Instruct weights on one GPU: zllm against HF transformers, same device.

    python benchmarks/real_model_check.py --model /tmp/smol.gguf [--json out.json]

For each zllm configuration (dtype, prefill path, step budget) it reports:
- perplexity of a fixed passage, from zllm's prompt logprobs, beside HF's in fp32 and bf16;
- greedy agreement: 16 prompts x 64 tokens, how many outputs equal HF fp32's token for token,
  and the mean length of the common prefix.
Configurations: fp32 (must equal HF), online FP8 (--quantization fp8) in bf16 and fp32, the FP8 KV
cache (--kv-cache-dtype fp8) in fp32 and bf16 and with FP8 weights, bf16 through the packed prefill (one FlashAttention call
per layer) and through the per-request loop (ZLLM_PACKED_PREFILL's A/B, switched in-process),
and bf16 packed with a 64-token step budget so that prompts arrive as chunks over cached prefixes;
with --batch-one, fp32, bf16 and FP8 weights again one sequence at a time (batch-1 decode steps,
the GEMV kernels' path).
Precision changes are checked with this script (DEVELOPERS.md: real weights on the GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import math

import torch

PASSAGE = (
    "The river starts as snowmelt high in the mountains, where thin streams gather in a stony basin "
    "before spilling over a ledge into the valley. Farmers along its banks have drawn water from it for "
    "centuries, building small channels that carry it to orchards and fields of barley. In spring the "
    "current grows fast and brown with silt; by late summer it slows, clears, and children wade across "
    "the shallows to reach the island of willows in the middle. A stone bridge, rebuilt twice after "
    "floods, joins the two villages that face each other across the water. Each autumn the villages "
    "hold a market on the bridge itself, selling apples, wool, honey and the small knives that the "
    "smiths of the eastern village are known for. Travellers who cross the pass stop there to rest "
    "their horses, trade news from the coast, and ask about the weather on the road ahead."
)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three uses of copper.",
    "Who wrote Pride and Prejudice?",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "Name the planets of the solar system.",
    "What does a compiler do?",
    "Suggest a name for a bakery.",
    "Summarize the plot of Hamlet.",
    "What is a prime number?",
]
MAX_TOKENS = 64


def hf_reference(model_dir: str, tokenizer, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    result = {}
    for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        ids = torch.tensor([tokenizer.encode(PASSAGE)], device=device)
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
        result[f"hf_{name}_ppl"] = round(math.exp(nll.item()), 3)
        if name == "fp32":
            outputs = []
            for prompt in PROMPTS:
                prompt_ids = torch.tensor([chat_ids(tokenizer, prompt)], device=device)
                with torch.no_grad():
                    out = model.generate(
                        prompt_ids,
                        max_new_tokens=MAX_TOKENS,
                        do_sample=False,
                        attention_mask=torch.ones_like(prompt_ids),
                    )
                outputs.append(out[0, prompt_ids.shape[1] :].tolist())
            result["hf_fp32_greedy"] = outputs
            result["hf_fp32_greedy_mean_len"] = round(sum(map(len, outputs)) / len(outputs), 1)
        del model
        release_memory()
    return result


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def zllm_run(
    model_dir: str,
    tokenizer,
    dtype: str,
    packed: bool,
    budget: int | None,
    reference: list[list[int]],
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    max_num_seqs: int | None = None,
    mixed_graph_max_tokens: int | None = None,
) -> dict:
    from zllm import LLM, SamplingParams
    from zllm.workers import ops

    ops._PACKED_PREFILL_ENABLED = packed
    kwargs = {"max_num_batched_tokens": budget} if budget else {}
    if max_num_seqs:
        kwargs["max_num_seqs"] = max_num_seqs
    if quantization:
        kwargs["quantization"] = quantization
    if mixed_graph_max_tokens is not None:
        kwargs["mixed_graph_max_tokens"] = mixed_graph_max_tokens
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=0.3,
        max_model_len=1024,
        **kwargs,
    )
    try:
        passage = tokenizer.encode(PASSAGE)
        [out] = llm.generate(
            [{"prompt_token_ids": passage}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
        nll = -sum(entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], passage[1:])) / (
            len(passage) - 1
        )
        outs = llm.generate(
            [{"prompt_token_ids": chat_ids(tokenizer, p)} for p in PROMPTS],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
        release_memory()
    ours = [list(o.outputs[0].token_ids) for o in outs]
    prefixes = [common_prefix(a, b) for a, b in zip(ours, reference)]
    return {
        "dtype": dtype,
        "quantization": quantization,
        "kv_cache_dtype": kv_cache_dtype,
        "packed_prefill": packed,
        "max_num_batched_tokens": budget,
        "max_num_seqs": max_num_seqs,
        "mixed_graph_max_tokens": mixed_graph_max_tokens,
        "ppl": round(math.exp(nll), 3),
        "greedy_equal": f"{sum(a == b for a, b in zip(ours, reference))}/{len(PROMPTS)}",
        "mean_common_prefix": round(sum(prefixes) / len(prefixes), 1),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory or a .gguf file")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--device", default="cuda", help="where HF runs (cpu: a quick check of this script)")
    parser.add_argument("--quick", action="store_true", help="skip the prefill-path and step-budget variants")
    parser.add_argument(
        "--batch-one",
        action="store_true",
        help="also generate one sequence at a time (max_num_seqs 1: batch-1 decode, the GEMVs)",
    )
    parser.add_argument(
        "--mixed-graph-max-tokens",
        type=int,
        help="the engine's mixed_graph_max_tokens (0: every step with prefill off the decode graph)",
    )
    args = parser.parse_args()
    from zllm.frontend.tokenizer import load_tokenizer
    from zllm.model_files import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    tokenizer = load_tokenizer(model_dir)
    hf = hf_reference(model_dir, tokenizer, args.device)
    reference = hf.pop("hf_fp32_greedy")
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                "passage_tokens": len(tokenizer.encode(PASSAGE)),
                **hf,
            }
        ),
        flush=True,
    )
    runs = []
    configs = [
        ("float32", True, None, None),
        ("bfloat16", True, None, None),
        ("bfloat16", False, None, None),
        ("bfloat16", True, 64, None),
        ("bfloat16", False, 64, None),
        ("bfloat16", True, None, "fp8"),
        ("float32", True, None, "fp8"),
        ("bfloat16", True, 64, "fp8"),
    ]
    configs = [(*c, "auto") for c in configs] + [  # the FP8 KV cache: alone, and with FP8 weights
        ("float32", True, None, None, "fp8"),
        ("bfloat16", True, None, None, "fp8"),
        ("bfloat16", True, None, "fp8", "fp8"),
    ]
    if args.quick:
        configs = [c for c in configs if c[1] and c[2] is None]
    configs = [(*c, None) for c in configs]
    if args.batch_one:  # every decode step at batch 1: the GEMV kernels (one token) on every projection
        configs += [
            ("float32", True, None, None, "auto", 1),
            ("bfloat16", True, None, None, "auto", 1),
            ("bfloat16", True, None, "fp8", "auto", 1),
        ]
    for dtype, packed, budget, quantization, kv_cache_dtype, max_num_seqs in configs:
        runs.append(
            zllm_run(
                model_dir,
                tokenizer,
                dtype,
                packed,
                budget,
                reference,
                quantization,
                kv_cache_dtype,
                max_num_seqs,
                args.mixed_graph_max_tokens,
            )
        )
        print(json.dumps(runs[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**hf, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
