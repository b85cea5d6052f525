"""Structured outputs in the engine: xgrammar in the engine core, the bitmask on rank 0.

The reference is HF transformers' greedy `generate` with xgrammar's own HF logits processor over
the same grammar (the tokens each grammar allows, computed by the library, applied by it):
zllm's fp32 output must equal it token for token, in every scheduling mode.
"""

from __future__ import annotations

import json
import re
import threading

import msgspec
import numpy as np
import pytest
import torch
import xgrammar as xgr

from tests.helpers.models import hf_greedy
from tests.helpers.structured import CODE, CONSTRAINTS, PROMPTS
from zllm import LLMEngine
from zllm.ipc.codec import Codec
from zllm.ipc.messages import AddRequest, CoreToWorker, GrammarBitmask
from zllm.sampling_params import SamplingParams, StructuredOutputsParams
from zllm.workers.sampler import apply_token_bitmask

MAX_TOKENS = 40


# ---- the bitmask ------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [49152, 100, 37])
def test_token_bitmask_masks_as_xgrammar_does(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    words = -(-vocab_size // 32)
    logits = torch.randn(6, vocab_size, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=generator)
    rows = [0, 2, 5]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    ours = logits.clone()
    apply_token_bitmask(ours, torch.tensor(rows), bitmask[rows])
    assert torch.equal(ours, expected)
    assert torch.equal(ours[[1, 3, 4]], logits[[1, 3, 4]])  # rows without a grammar are untouched


def test_grammar_bitmask_message_carries_its_rows():
    rows = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
    message = GrammarBitmask.of(9, ["a", "b", "c"], rows)
    codec: Codec = Codec(CoreToWorker)
    decoded = codec.decode(codec.encode(message))
    assert decoded.step_id == 9 and np.array_equal(decoded.rows(), rows)
    with pytest.raises(ValueError, match="bytes, expected"):
        msgspec.structs.replace(decoded, words=5).rows()


# ---- against HF + xgrammar ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_info(smollm2_dir, smollm2_tokenizer):
    from zllm.frontend.tokenizer import eos_token_ids

    eos = eos_token_ids(smollm2_dir, smollm2_tokenizer)
    vocab = json.load(open(f"{smollm2_dir}/config.json"))["vocab_size"]
    return xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=vocab, stop_token_ids=eos), eos


@pytest.fixture(scope="module")
def hf_constrained(hf_smollm2, smollm2_tokenizer, tokenizer_info) -> dict[str, list[int]]:
    """HF greedy under xgrammar's HF logits processor, one grammar per prompt."""
    from xgrammar.contrib.hf import LogitsProcessor

    from zllm.grammars import grammar_of

    info, eos = tokenizer_info
    compiler = xgr.GrammarCompiler(info)
    reference = {}
    for name, params in CONSTRAINTS.items():
        processor = LogitsProcessor(compiler.compile_grammar(grammar_of(params)))
        ids = smollm2_tokenizer.encode(PROMPTS[name])
        reference[name] = hf_greedy(hf_smollm2, ids, MAX_TOKENS, eos, logits_processor=[processor])
    return reference


def run_constrained(engine: LLMEngine, names: list[str], stagger: bool = True) -> dict[str, list[int]]:
    """One request per constraint, two joining the batch per step."""
    pending = list(names)
    results: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(2 if stagger else len(pending)):
            if pending:
                name = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[name])
                engine.add_request(name, PROMPTS[name], params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return results


def drain(engine: LLMEngine) -> None:
    while engine.core.has_unfinished_requests():
        engine.step()


ENGINES = {
    "sync": {},
    "async": {"async_scheduling": True},
    # 4 blocks of 8 tokens: the JSON request (27 tokens) needs all of them, so whoever runs beside
    # it when it grows is preempted.
    "preempt-async": {"async_scheduling": True, "num_kv_blocks": 4, "block_size": 8, "max_model_len": 32},
    "chunked": {"max_num_batched_tokens": 3},
    "no-prefix-cache": {"enable_prefix_caching": False},
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(ENGINES))
def test_constrained_greedy_equals_hf_with_xgrammar(smollm2_dir, hf_constrained, mode):
    engine = LLMEngine.from_engine_args(smollm2_dir, dtype="float32", **ENGINES[mode])
    try:
        assert run_constrained(engine, list(CONSTRAINTS), stagger=not mode.startswith("preempt")) == hf_constrained
        drain(engine)
        assert engine.core.scheduler.kv_cache.pool.num_free_blocks == engine.core.num_kv_blocks
        if mode.startswith("preempt"):
            assert engine.core.stats().num_preemptions > 0
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_the_text_follows_each_grammar(smollm2_dir, smollm2_tokenizer, hf_constrained):
    text = {name: smollm2_tokenizer.decode(ids, skip_special_tokens=True) for name, ids in hf_constrained.items()}
    person = json.loads(text["json"])
    assert set(person) == {"name", "age", "city"} and person["city"] in ("Paris", "Rome", "Oslo")
    assert re.fullmatch(CODE, text["regex"]) and text["choice"] in ("red", "green", "blue")
    assert re.fullmatch(r"\(\d+( \+ \d+)*\)", text["grammar"]) and isinstance(json.loads(text["json_object"]), dict)


@pytest.mark.slow
def test_tensor_parallel_workers_sample_under_the_grammar(smollm2_dir, hf_constrained):
    """tp 2: worker processes, the bitmask over the socket to rank 0 only, async scheduling."""
    engine = LLMEngine.from_engine_args(smollm2_dir, dtype="float32", tensor_parallel_size=2, async_scheduling=True)
    try:
        assert run_constrained(engine, list(CONSTRAINTS), stagger=False) == hf_constrained
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_n_completions_each_follow_the_grammar_and_repeat_with_their_seed(smollm2_dir):
    from zllm import LLM

    llm = LLM(smollm2_dir, dtype="float32")
    params = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=12, structured_outputs=CONSTRAINTS["regex"])
    first = llm.generate(["My order code is"], params)[0]
    again = llm.generate(["My order code is"], params)[0]  # its prompt blocks now come from the prefix cache
    texts = [c.text for c in first.outputs]
    assert all(re.fullmatch(CODE, t) for t in texts) and len(set(texts)) > 1, texts
    assert [c.text for c in again.outputs] == texts
    llm.shutdown()


@pytest.mark.slow
def test_a_request_resumed_after_an_engine_restart_continues_its_grammar(
    smollm2_dir, smollm2_tokenizer, hf_constrained
):
    """Crash recovery re-sends a request with the tokens its client already has: the new core's
    matcher must take them first, so the rest follows the grammar as if nothing happened."""
    from zllm.frontend.tokenizer import eos_token_ids

    engine = LLMEngine.from_engine_args(smollm2_dir, dtype="float32")
    try:
        reference = hf_constrained["json"]
        prompt = smollm2_tokenizer.encode(PROMPTS["json"])
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["json"])
        engine.core.add_request(
            AddRequest(
                "r",
                prompt,
                params,
                0.0,
                eos_token_ids=eos_token_ids(smollm2_dir, smollm2_tokenizer),
                output_token_ids=reference[:7],
                resumed=True,
            )
        )
        tokens = []
        while engine.core.has_unfinished_requests():
            tokens += [t for delta in engine.core.step() for t in delta.new_token_ids]
        assert reference[:7] + tokens == reference
    finally:
        engine.shutdown()


# ---- the busy loop never waits for a compile -----------------------------------------------------------


@pytest.mark.slow
def test_a_slow_compile_holds_back_its_request_alone(smollm2_dir, monkeypatch):
    from zllm.enginecore.structured_outputs import StructuredOutputs

    release = threading.Event()
    compile_now = StructuredOutputs._compile_now

    def slow_compile(self, params):
        if params.regex is not None:
            release.wait(60)
        return compile_now(self, params)

    monkeypatch.setattr(StructuredOutputs, "_compile_now", slow_compile)
    engine = LLMEngine.from_engine_args(smollm2_dir, dtype="float32")
    try:
        engine.add_request(
            "slow",
            "My order code is",
            SamplingParams(temperature=0, max_tokens=8, structured_outputs=CONSTRAINTS["regex"]),
        )
        engine.add_request("free", "Hello", SamplingParams(temperature=0, max_tokens=8))
        engine.add_request(
            "choice", "Pick:", SamplingParams(temperature=0, max_tokens=8, structured_outputs=CONSTRAINTS["choice"])
        )
        finished = set()
        for _ in range(200):
            finished |= {out.request_id for out in engine.step() if out.finished}
            if {"free", "choice"} <= finished:
                break
        assert {"free", "choice"} <= finished and "slow" not in finished
        release.set()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            finished |= {out.request_id for out in outputs if out.finished}
        assert "slow" in finished
    finally:
        release.set()
        engine.shutdown()


@pytest.mark.slow
def test_a_grammar_the_core_cannot_compile_fails_that_request_alone(smollm2_dir, monkeypatch):
    from zllm.enginecore.structured_outputs import StructuredOutputs

    def broken(self, params):
        raise ValueError("structured_outputs: broken on purpose")

    monkeypatch.setattr(StructuredOutputs, "_compile_now", broken)
    engine = LLMEngine.from_engine_args(smollm2_dir, dtype="float32")
    try:
        engine.add_request("bad", "Hi", SamplingParams(max_tokens=4, structured_outputs=CONSTRAINTS["regex"]))
        engine.add_request("good", "Hi", SamplingParams(temperature=0, max_tokens=4))
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({out.request_id: out for out in engine.step() if out.finished})
        assert outputs["bad"].outputs[0].finish_reason == "error"
        assert len(outputs["good"].outputs[0].token_ids) == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(regex="(unclosed"), "the regex cannot be compiled"),
        (StructuredOutputsParams(grammar="root ::= ("), "the grammar cannot be compiled"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "the JSON schema cannot be compiled"),
    ],
)
def test_the_frontend_refuses_what_xgrammar_cannot_build(params, message):
    from zllm.grammars import grammar_of

    with pytest.raises(ValueError, match=f"^structured_outputs: {message}"):
        grammar_of(params)
