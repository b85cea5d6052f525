"""What the process split costs: the same workload in one process and across processes.

    python benchmarks/ipc_overhead.py [--model DIR] [--tiny] [--num-prompts 32 --input-len 64 --output-len 64]

In-process: LLMEngine with the engine core and worker in this process. Across processes:
`vllm-launch` (frontend -> engine core -> worker over ZeroMQ) driven by one AsyncClient.
Reports output tokens/s for both and the added time per engine step in microseconds
((t_processes - t_inprocess) / steps). --tiny shrinks the model to one narrow layer
(random weights) so the per-step cost of the plumbing is not hidden behind compute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def tiny_copy(model_dir: str, target: Path) -> str:
    """The model's tokenizer with a 1-layer, 64-wide config (weights come from --load-format dummy)."""
    import shutil

    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, name), target / name)
    config = json.loads((target / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


def workload(num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(input_len)] for _ in range(num_prompts)]


def run_inprocess(model: str, prompts, params, load_format: str) -> tuple[float, int]:
    from zllm import LLMEngine

    engine = LLMEngine.from_engine_args(
        model, load_format=load_format, max_model_len=2048, kv_cache_memory_bytes=256 << 20
    )
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start, engine.core.stats().num_steps


def run_processes(model: str, prompts, params, load_format: str, workdir: Path) -> tuple[float, int]:
    from zllm import AsyncClient, Client

    endpoint = f"ipc://{workdir}/bench.sock"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zllm.launch.cli",
            "--model",
            model,
            "--zmq-endpoint",
            endpoint,
            "--load-format",
            load_format,
            "--max-model-len",
            "2048",
            "--kv-cache-memory",
            "256MiB",
            "--log-level",
            "WARNING",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        while "zllm ready" not in server.stdout.readline():
            if server.poll() is not None:
                raise RuntimeError("server failed to start")

        async def drive() -> float:
            async with AsyncClient(endpoint) as client:
                start = time.perf_counter()
                await asyncio.gather(
                    *[client.generate(prompt_token_ids=ids, sampling_params=params) for ids in prompts]
                )
                return time.perf_counter() - start

        elapsed = asyncio.run(drive())
        with Client(endpoint) as client:
            steps = client.stats()["num_steps"]
        return elapsed, steps
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from zllm import SamplingParams
    from zllm.model_files import resolve_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model = str(resolve_model_dir(args.model))
        load_format = "auto"
        if args.tiny:
            (workdir / "tiny").mkdir()
            model, load_format = tiny_copy(model, workdir / "tiny"), "dummy"
        prompts = workload(args.num_prompts, args.input_len, args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        run_inprocess(model, prompts[:2], params, load_format)  # warm-up: imports, allocator
        t_in, steps_in = run_inprocess(model, prompts, params, load_format)
        t_mp, steps_mp = run_processes(model, prompts, params, load_format, workdir)
    tokens = args.num_prompts * args.output_len
    print(
        json.dumps(
            {
                "model": "tiny-1-layer" if args.tiny else os.path.basename(model),
                "num_prompts": args.num_prompts,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "inprocess_s": round(t_in, 3),
                "inprocess_tokens_per_s": round(tokens / t_in, 1),
                "inprocess_steps": steps_in,
                "processes_s": round(t_mp, 3),
                "processes_tokens_per_s": round(tokens / t_mp, 1),
                "processes_steps": steps_mp,
                "overhead_us_per_step": round((t_mp - t_in) / steps_mp * 1e6, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
