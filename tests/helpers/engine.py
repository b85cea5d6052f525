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
