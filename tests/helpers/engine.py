"""The offline engine's greedy tokens for a batch of token-id prompts (fp32, ignoring EOS), and a spy
on the worker's choice to lay prompt tokens out as decode rows."""

from __future__ import annotations

from zllm import LLMEngine, SamplingParams

# Two prompts longer than one 16-token block, one shorter, one of exactly ten.
PROMPTS = [[5, 9, 13], list(range(3, 40)), [7] * 5 + list(range(100, 140)), [250, 251, 3, 4, 5, 6, 7, 8, 9, 10]]


def engine_generate_all(model_dir, prompts, max_new_tokens, **engine_args):
    engine = LLMEngine.from_engine_args(str(model_dir), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    results = {}
    while engine.has_unfinished_requests():
        results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [results[str(i)] for i in range(len(prompts))]


def count_row_steps(monkeypatch) -> list[bool]:
    """Spy on ModelRunner._prefill_as_rows (an in-process worker): each step's answer, in order, so
    a test of mixed_graph_max_tokens can check that its prompt tokens did go in as decode rows."""
    from zllm.workers.model_runner import ModelRunner

    answers: list[bool] = []
    decide = ModelRunner._prefill_as_rows

    def spied(self, step):
        answers.append(decide(self, step))
        return answers[-1]

    monkeypatch.setattr(ModelRunner, "_prefill_as_rows", spied)
    return answers


# Short prompts for batch-1 decode checks (one of a single token).
DECODE_PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 40, 41, 42, 7], [64]]


def batch_one_decode(model_dir, prompts=DECODE_PROMPTS, **engine_args) -> tuple[list[list[int]], list[list[dict]]]:
    """Batch-1 decode on a GPU (one sequence at a time, 24 tokens each): greedy tokens and their
    top-5 logprobs, for tests that a switch leaves every bit of a decode step alone. Checks that
    CUDA graphs ran unless enforce_eager; the engine is shut down even when the run fails."""
    from zllm import LLM

    llm = LLM(
        str(model_dir), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=1, max_model_len=256, **engine_args
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5),
            use_tqdm=False,
        )
        graphs = llm.engine.core.executor.runner.graphs is not None
        assert graphs != engine_args.get("enforce_eager", False)
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs
