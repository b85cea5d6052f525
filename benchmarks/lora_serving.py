"""Multi-LoRA benchmarks (issue 34): serving throughput and latency with adapters, and the
csrc/lora_kernels.cu shrink/expand alone against the torch reference.

    python benchmarks/dummy_model.py llama3-8b /tmp/llama3-8b
    # W1 (1000 x 256 in / 256 out): no LoRA, then spread round-robin over 8 and 64 adapters
    python benchmarks/lora_serving.py w1 --model /tmp/llama3-8b --adapters 0
    python benchmarks/lora_serving.py w1 --model /tmp/llama3-8b --adapters 8 --max-loras 8
    python benchmarks/lora_serving.py w1 --model /tmp/llama3-8b --adapters 64 --max-loras 16
    # W2 (batch 1, 128 in / 256 out, ms per output token after the first): plain, one adapter
    python benchmarks/lora_serving.py w2 --model /tmp/llama3-8b --adapters 0
    python benchmarks/lora_serving.py w2 --model /tmp/llama3-8b --adapters 1
    # W2 with the expand as its own launch, then in the GEMV's epilogue (the default)
    ZLLM_LORA_FUSED_EXPAND=0 python benchmarks/lora_serving.py w2 --model /tmp/llama3-8b --adapters 1
    ZLLM_LORA_FUSED_EXPAND=1 python benchmarks/lora_serving.py w2 --model /tmp/llama3-8b --adapters 1
    # W2 with q/k/v's and gate/up's shrink in the add-RMSNorm before them and down's in the
    # activation (off by default); with PDL (ZLLM_PDL=1) against the plain model with PDL
    ZLLM_LORA_NORM_SHRINK=1 python benchmarks/lora_serving.py w2 --model /tmp/llama3-8b --adapters 1
    ZLLM_PDL=1 python benchmarks/lora_serving.py w2 --model /tmp/llama3-8b --adapters 0
    ZLLM_PDL=1 ZLLM_LORA_NORM_SHRINK=1 python benchmarks/lora_serving.py w2 --model /tmp/llama3-8b --adapters 1
    # the kernels alone per Llama-3-8B projection shape (us per call, GB/s), against torch's path;
    # at 1 token also the whole projection: GEMV + shrink + expand against shrink + fused GEMV
    python benchmarks/lora_serving.py kernels --model /tmp/llama3-8b

Adapters are random rank-`--rank` (16) PEFT directories on all seven projections of the model's
shape, written under --adapter-dir (bf16 safetensors, PEFT's tensor names and config); weights
are dummy (`--load-format dummy`). One JSON line per run (with the ZLLM_LORA_FUSED_EXPAND,
ZLLM_LORA_NORM_SHRINK and ZLLM_PDL in force); ZLLM_LORA_KERNELS=0 runs the torch path.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model: str, directory: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """`count` random PEFT adapter directories for the model's shape (kept if already there)."""
    import torch
    from safetensors.torch import save_file

    from zllm.lora import projection_shape
    from zllm.model_spec import ModelSpec

    spec = ModelSpec.from_pretrained(model)
    paths = []
    for index in range(count):
        path = directory / f"adapter-{rank}-{index}"
        paths.append(path)
        if (path / "adapter_model.safetensors").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(seed + index)
        tensors = {}
        for layer in range(spec.num_layers):
            for module in PROJECTIONS:
                kind = "self_attn" if module in PROJECTIONS[:4] else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{kind}.{module}"
                in_features, out_features = projection_shape(spec, module)
                a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
                b = torch.randn(out_features, rank, generator=generator) * 0.01
                tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
        (path / "adapter_config.json").write_text(json.dumps(config))
    return paths


def build_llm(args, max_model_len: int):
    from zllm import LLM

    lora = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank) if args.adapters else {}
    return LLM(
        args.model,
        load_format=args.load_format,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        **lora,
    )


def lora_requests(args) -> list:
    from zllm import LoRARequest

    paths = write_adapters(args.model, Path(args.adapter_dir), args.adapters, args.rank)
    return [LoRARequest(path.name, i + 1, str(path)) for i, path in enumerate(paths)]


def run_w1(args) -> dict:
    from zllm import SamplingParams

    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(256)]} for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False)
    loras = lora_requests(args)
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    llm = build_llm(args, 1024)
    llm.generate(prompts[:2], params, use_tqdm=False, lora_request=per_prompt[:2] if loras else None)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)
    elapsed = time.perf_counter() - start
    return report(args, "w1", requests_per_s=round(len(prompts) / elapsed, 2), elapsed_s=round(elapsed, 2))


def run_w2(args) -> dict:
    from zllm import SamplingParams

    rng = random.Random(args.seed)
    prompt = {"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(128)]}
    loras = lora_requests(args)
    lora = loras[0] if loras else None
    llm = build_llm(args, 1024)

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        return time.perf_counter() - start

    timed(16)  # warm-up
    per_token, ttft = [], []
    for _ in range(args.iters):
        first, whole = timed(1), timed(256)
        ttft.append(first * 1000)
        per_token.append((whole - first) / 255 * 1000)
    return report(
        args, "w2", ms_per_token=round(statistics.median(per_token), 3), ttft_ms=round(statistics.median(ttft), 1)
    )


def run_kernels(args) -> list[dict]:
    """Per Llama projection shape and token count: the kernels, the dense path (GEMMs over every
    slot) and the torch path, graph-timed; `default` says which of the first two the engine runs."""
    import torch

    from benchmarks.gpu_timing import graph_time_us
    from zllm.model_spec import ModelSpec
    from zllm.workers.kernels.lora import lora_expand, lora_shrink
    from zllm.workers.lora import dense_add, dense_from

    spec = ModelSpec.from_pretrained(args.model)
    q, kv, h, inter, r = (
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.hidden_size,
        spec.intermediate_size,
        args.rank,
    )
    shapes = {
        "qkv": (h, [q, q + kv, q + 2 * kv]),
        "o": (q, [h]),
        "gate_up": (h, [inter, 2 * inter]),
        "down": (inter, [h]),
    }
    results = []
    for name, (in_features, ends) in shapes.items():
        for tokens in (1, 16, 64, 256, 2048):
            slots, dtype, device = args.max_loras, torch.bfloat16, "cuda"
            a = torch.randn(slots, len(ends) * r, in_features, device=device, dtype=dtype)
            b = torch.randn(ends[-1], slots, r, device=device, dtype=dtype)  # [out, S, R]
            x = torch.randn(tokens, in_features, device=device, dtype=dtype)
            out = torch.randn(tokens, ends[-1], device=device, dtype=dtype)
            token_slots = (torch.arange(tokens, device=device, dtype=torch.int32) % slots).contiguous()
            t = torch.empty(tokens, len(ends) * r, device=device)
            mask = torch.nn.functional.one_hot(token_slots.long(), slots).to(dtype)
            starts = [0, *ends[:-1]]
            part_rows = [(start, end - start) for start, end in zip(starts, ends)]

            def kernels(_: int) -> None:
                lora_expand(out, lora_shrink(t, x, a, token_slots), b, token_slots, ends)

            def dense(_: int) -> None:
                dense_add(out, x, a, b, mask, part_rows)

            groups = [(s, torch.nonzero(token_slots == s).flatten()) for s in range(slots)]

            def torch_path(_: int) -> None:  # zllm/workers/lora.py's LoRALayer.apply_slot, per group
                for s, rows in groups:
                    shrunk = torch.nn.functional.linear(x.index_select(0, rows), a[s])
                    delta = torch.cat(
                        [
                            torch.nn.functional.linear(shrunk[:, p * r : (p + 1) * r], b[start:end, s])
                            for p, (start, end) in enumerate(zip(starts, ends))
                        ],
                        dim=-1,
                    )
                    out.index_add_(0, rows, delta)

            used = min(tokens, slots)
            nbytes = (used * (a[0].numel() + b[0].numel()) + x.numel() + 2 * out.numel()) * 2
            default = "dense" if tokens >= dense_from(slots) else "kernels"
            for path, fn in (("kernels", kernels), ("dense", dense), ("torch", torch_path)):
                us = graph_time_us(fn, calls=20, replays=20)
                row = dict(benchmark="lora_kernels", shape=name, tokens=tokens, slots=slots, rank=r, path=path)
                row |= dict(default=path == default)
                row |= dict(us=round(us, 2), gb_per_s=round(nbytes / us / 1e3, 1))
                print(json.dumps(row), flush=True)
                results.append(row)
            if tokens == 1:
                results += projection_at_batch_1(name, in_features, ends, x, a, b, t, token_slots)
    return results


def projection_at_batch_1(name, in_features, ends, x, a, b, t, token_slots) -> list[dict]:
    """One adapted projection at batch 1, graph-timed: the GEMV alone, then with LoRA as the
    unfused kernels (GEMV, shrink, expand: three launches) and fused (shrink, GEMV with the expand
    in its epilogue: two)."""
    import torch

    from benchmarks.gpu_timing import graph_time_us
    from zllm.workers.kernels import LoRAEpilogue, gemv
    from zllm.workers.kernels.lora import lora_expand, lora_shrink

    weight = torch.randn(ends[-1], in_features, device="cuda", dtype=x.dtype) / in_features**0.5
    y = torch.empty(1, ends[-1], device="cuda", dtype=x.dtype)
    lora = LoRAEpilogue(t, b, token_slots, ends)
    paths = {
        "gemv": lambda _: gemv(y, x, weight),
        "gemv+shrink+expand": lambda _: lora_expand(
            gemv(y, x, weight), lora_shrink(t, x, a, token_slots), b, token_slots, ends
        ),
        "shrink+gemv_lora": lambda _: gemv(y, x, weight, lora=lora._replace(t=lora_shrink(t, x, a, token_slots))),
    }
    rows = []
    for path, fn in paths.items():
        us = graph_time_us(fn, calls=20, replays=20)
        row = dict(benchmark="lora_projection", shape=name, tokens=1, rank=b.shape[2], path=path, us=round(us, 2))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def report(args, workload: str, **values) -> dict:
    from zllm import envs

    row = dict(workload=workload, adapters=args.adapters, max_loras=args.max_loras, rank=args.rank)
    row |= dict(fused_expand=envs.ZLLM_LORA_FUSED_EXPAND, norm_shrink=envs.ZLLM_LORA_NORM_SHRINK, pdl=envs.ZLLM_PDL)
    row |= values
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["w1", "w2", "kernels"])
    parser.add_argument("--model", required=True, help="a model directory (benchmarks/dummy_model.py)")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--adapters", type=int, default=8, help="adapters the requests spread over (0: no LoRA)")
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapter-dir", default="/tmp/zllm-lora-adapters")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    {"w1": run_w1, "w2": run_w2, "kernels": run_kernels}[args.workload](args)


if __name__ == "__main__":
    main()
