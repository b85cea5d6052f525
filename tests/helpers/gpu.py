"""The engine on a GPU against HF transformers on the same GPU: random Llama shapes (the GPU
machines have no model files and no network), greedy tokens from each, how much of them agree,
and a results file ($OUT/gpu_results.jsonl) for the figures a run book reports."""

from __future__ import annotations

import json
import os

MAX_TOKENS = 32
# The reference models are random Llamas made with transformers' own classes (head_dim 64 and
# 128, GQA), with larger initial weights so the greedy choice is not a near-tie
# (tests/gpu/conftest.py's model_dir fixture builds one of each).
SHAPES = {
    "gqa-d64": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "gqa-d128": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        rope_theta=500000.0,
    ),
    # Qwen3: the per-head q/k RMSNorm through the CUDA rms_norm kernel.
    "qwen3-d128": dict(
        architecture="qwen3",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    ),
}
PROMPT_LENGTHS = [1, 3, 15, 16, 17, 40, 129, 400]


def engine_tokens(model_dir, prompt_ids, **engine_args) -> list[list[int]]:
    """The engine's greedy tokens for each prompt (staggered arrivals); the engine is shut down
    however this ends, so a failure leaves no GPU KV cache behind."""
    # Imported here: tests/gpu/conftest.py imports this module, and the kernel tests run without
    # the engine's own dependencies (pyzmq, msgspec).
    from zllm import LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(model_dir, device="cuda", max_model_len=2048, **engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        for i, ids in enumerate(prompt_ids):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
            if i % 3 == 2:
                engine.step()  # staggered arrival: join a running batch
        results = {}
        while engine.has_unfinished_requests():
            results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    finally:
        engine.shutdown()
    return [results[str(i)] for i in range(len(prompt_ids))]


def hf_tokens(model_dir, prompt_ids, dtype) -> list[list[int]]:
    """HF transformers' greedy tokens for each prompt (batch 1) on the GPU, in this dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **_hf_attention(model_dir)).cuda().eval()
    eos = model.generation_config.eos_token_id
    out = []
    for ids in prompt_ids:
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([ids], device="cuda"),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
            )
        out.append(generated[0, len(ids) :].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def _hf_attention(model_dir) -> dict:
    """Soft-capped attention (Gemma 2) only in HF's eager attention: some transformers versions
    (5.17 on the GPU machines) pick SDPA for Gemma 2, which drops the cap without a word."""
    from transformers import AutoConfig

    capped = getattr(AutoConfig.from_pretrained(model_dir), "attn_logit_softcapping", None)
    return {"attn_implementation": "eager"} if capped else {}


def share_identical(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where the two agree, counting a position only while all before it agree."""
    same = total = 0
    for x, y in zip(a, b):
        for i in range(max(len(x), len(y))):
            total += 1
            same += i < len(x) and i < len(y) and x[i] == y[i] and x[:i] == y[:i]
    return same / total


def record(name: str, value) -> None:
    """Print a figure, and append it to $OUT/gpu_results.jsonl when $OUT is set."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_results.jsonl"), "a") as f:
            f.write(json.dumps({name: value}) + "\n")
    print(f"{name}: {value}")


def forbid_host_syncs(runner, names: tuple[str, ...] = ("launch_step", "sample_step")) -> None:
    """Wrap these methods of a model runner so that any host-device sync inside them raises
    (torch's sync debug mode "error" while they run)."""
    import torch

    for name in names:
        original = getattr(runner, name)

        def strict(*args, _original=original, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        setattr(runner, name, strict)
