"""Structured outputs on the GPU: the bitmask applied on the device equals xgrammar's own, and
constrained greedy decoding (decode graphs, async scheduling) equals HF transformers' generate
with xgrammar's HF logits processor on the same GPU, token for token, in fp32.

Grammars need a real sub-word tokenizer and the GPU machines carry none: a byte-level BPE one is
trained here on a few sentences (tests/helpers/structured.py) with the `tokenizers` library, and
the model is a random Llama over its vocabulary made here with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from tests.helpers.models import hf_greedy, save_tiny_model, train_subword_tokenizer
from tests.helpers.structured import CONSTRAINTS, PROMPTS, SUBWORD_CORPUS
from zllm import LLMEngine
from zllm.sampling_params import SamplingParams
from zllm.workers.sampler import apply_token_bitmask

pytestmark = pytest.mark.gpu
MAX_TOKENS = 32


@pytest.mark.parametrize("vocab_size", [128256, 49152, 37])
def test_device_bitmask_equals_xgrammar(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(64, vocab_size, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, -(-vocab_size // 32)), dtype=torch.int32, generator=generator)
    rows = list(range(0, 64, 3))
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)  # xgrammar's CPU kernel: the reference
    ours = logits.cuda()
    apply_token_bitmask(ours, torch.tensor(rows, device="cuda"), bitmask[rows].cuda())
    assert torch.equal(ours.cpu(), expected)


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> Path:
    tokenizer = train_subword_tokenizer(SUBWORD_CORPUS)
    directory = save_tiny_model(
        tmp_path_factory.mktemp("bpe"),
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
    )
    tokenizer.save_pretrained(directory)  # in place of save_tiny_model's placeholder
    return directory


def test_constrained_greedy_on_the_gpu_equals_hf_with_xgrammar(bpe_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from xgrammar.contrib.hf import LogitsProcessor

    from zllm.frontend.tokenizer import eos_token_ids
    from zllm.grammars import grammar_of

    tokenizer = AutoTokenizer.from_pretrained(bpe_model)
    eos = eos_token_ids(str(bpe_model), tokenizer)
    vocab_size = json.loads((bpe_model / "config.json").read_text())["vocab_size"]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    hf = AutoModelForCausalLM.from_pretrained(bpe_model, dtype=torch.float32).cuda().eval()
    prompts = {name: tokenizer.encode(text) for name, text in PROMPTS.items()}
    expected = {}
    for name, params in CONSTRAINTS.items():
        processor = LogitsProcessor(compiler.compile_grammar(grammar_of(params)))
        expected[name] = hf_greedy(hf, prompts[name], MAX_TOKENS, eos, logits_processor=[processor])
    del hf
    torch.cuda.empty_cache()
    for async_scheduling in (False, True):
        engine = LLMEngine.from_engine_args(
            str(bpe_model),
            device="cuda",
            dtype="float32",
            max_model_len=512,
            async_scheduling=async_scheduling,
            gpu_memory_utilization=0.3,
        )
        try:
            for name, params in CONSTRAINTS.items():
                engine.add_request(
                    name,
                    {"prompt_token_ids": prompts[name]},
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=params),
                )
            results = {}
            while engine.has_unfinished_requests():
                results.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            assert results == expected, f"async_scheduling={async_scheduling}"
        finally:
            engine.shutdown()
