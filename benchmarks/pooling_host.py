"""The host's cost per input of `LLM.embed`, by stage, with the model's forward taken out.

    python benchmarks/pooling_host.py [--minilm-dir DIR] [--n 10000] [--per-request]

all-MiniLM-L6-v2 on the CPU (fp32), --n sentences of 16-128 tokens (embed_throughput.py's). The
model's forward is replaced by a preallocated zero hidden state, and the texts are tokenized
before the clock starts (the batch gets the tokenizer's own ids, as LLM's tokenizer thread gives
them), so what is timed is the host's bookkeeping alone: the frontend's checks, the engine core
and its scheduler, the pooling runner around the forward (inputs, pooling, vectors back) and
the outputs. --per-request: one request per input (the path mixed inputs take), for comparison;
--read-vectors: every output's list of floats read inside the clock (they are built when read).
Prints one JSON line: microseconds per input, in total and per stage (the best of --repeats).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from embed_throughput import make_sentences, minilm_dir  # noqa: E402


class _Timers:
    """Seconds spent in wrapped methods (outermost calls only, per stage)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, stage: str) -> None:
        if not hasattr(owner, name):
            return  # an older zllm (no pooling batches): the script times its per-request path
        inner = getattr(owner, name)
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[stage] += time.perf_counter() - start

        setattr(owner, name, timed)


class _ZeroForward:
    """The model without its forward: a slice of one preallocated zero hidden state."""

    def __init__(self, model, hidden_size: int, max_tokens: int, timers: _Timers) -> None:
        import torch

        self.head = model.head
        self.head_reads_first = getattr(model, "head_reads_first", False)
        self.hidden = torch.zeros(max_tokens, hidden_size)
        self.timers = timers

    def __call__(self, token_ids, positions, token_types, groups):
        start = time.perf_counter()
        hidden = self.hidden[: token_ids.shape[0]]
        self.timers.seconds["forward (excluded)"] += time.perf_counter() - start
        return hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minilm-dir", default=None)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-request", action="store_true", help="one request per input (no pooling batches)")
    parser.add_argument(
        "--read-vectors", action="store_true", help="read every output's list of floats inside the clock too"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    args = parser.parse_args()

    import torch

    from zllm import LLM

    torch.set_num_threads(1)  # the pooling ops' threads would compete with the host's work on a small CPU
    model_dir = minilm_dir(args.minilm_dir)
    sentences = make_sentences(model_dir, args.n, 16, 128, 0)
    llm = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    tokenizer = llm.get_tokenizer()
    ids = dict(zip(sentences, tokenizer(sentences)["input_ids"]))
    # The tokenizer thread's answer without the tokenizer's time.
    llm._token_ids_of = lambda prompts: [ids[p] for p in prompts]
    llm._tokenized_together = lambda prompts: [{"prompt": p, "prompt_token_ids": ids[p]} for p in prompts]
    if args.per_request:
        llm._batchable = lambda prompts: False

    timers = _Timers()
    core = llm.engine.core
    runner = core.executor.runner
    runner.model = _ZeroForward(runner.model, runner.spec.hidden_size, args.max_num_batched_tokens, timers)
    processor = llm.engine.processor
    timers.wrap(processor, "process", "frontend: processor")
    timers.wrap(processor, "process_pooling_batch", "frontend: processor")
    timers.wrap(core, "add_request", "core: add")
    timers.wrap(core, "add_pooling_batch", "core: add")
    timers.wrap(core.scheduler, "schedule", "core: schedule")
    timers.wrap(core.scheduler, "update_from_output", "core: update")
    timers.wrap(runner, "launch_step", "worker: launch (with forward)")
    timers.wrap(runner, "finish_step", "worker: finish")
    timers.wrap(runner, "_pooled", "worker: pooling ops (device work on a GPU)")
    llm.embed(sentences[:256], use_tqdm=False)  # warm-up

    best = None
    for _ in range(args.repeats):
        timers.seconds.clear()
        start = time.perf_counter()
        outputs = llm.embed(sentences, use_tqdm=False)
        if args.read_vectors:
            for output in outputs:
                output.outputs.embedding  # noqa: B018 (a batch's rows become lists when read)
        elapsed = time.perf_counter() - start
        if best is None or elapsed < best[0]:
            best = (elapsed, dict(timers.seconds))
    llm.shutdown()
    assert len(outputs) == args.n and len(outputs[0].outputs.embedding) == 384

    elapsed, stages = best
    forward = stages.pop("forward (excluded)", 0.0)
    pooling_ops = stages.get("worker: pooling ops (device work on a GPU)", 0.0)
    stages["worker: launch"] = stages.pop("worker: launch (with forward)") - forward - pooling_ops
    stages["LLM: feeding, finishing, outputs (the rest)"] = elapsed - forward - sum(stages.values())
    per_input = {name: round(seconds / args.n * 1e6, 2) for name, seconds in stages.items()}
    print(
        json.dumps(
            {
                "path": "per-request" if args.per_request else "pooling batches",
                "vectors_read": args.read_vectors,
                "inputs": args.n,
                "host_us_per_input": round((elapsed - forward) / args.n * 1e6, 2),
                "stages_us_per_input": per_input,
            }
        )
    )


if __name__ == "__main__":
    main()
