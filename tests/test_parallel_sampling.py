"""n > 1 in the frontend: fan-out into child requests, and the OutputProcessor merging their
deltas (and logprob rows) back into one RequestOutput."""

from __future__ import annotations

import pytest

from zllm.frontend.output_processor import OutputProcessor
from zllm.frontend.parallel_sampling import fan_out
from zllm.ipc.messages import AddRequest, TokenDelta, TokenLogprobs
from zllm.outputs import Logprob
from zllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def add_request(request_id: str = "r", **sampling) -> AddRequest:
    return AddRequest(request_id, [1, 2, 3], SamplingParams(**sampling), 0.0, eos_token_ids=[2], priority=1)


def test_n_of_one_is_sent_as_is():
    message = add_request(n=1, seed=5)
    assert fan_out(message) == [message]


def test_children_get_their_own_ids_and_seeds_and_only_the_first_computes_prompt_logprobs():
    children = fan_out(add_request(n=3, seed=2**64 - 2, prompt_logprobs=2, logprobs=1, temperature=0.5))
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    assert [c.sampling.seed for c in children] == [2**64 - 2, 2**64 - 1, 0]
    assert [c.sampling.n for c in children] == [1, 1, 1]
    assert [c.sampling.prompt_logprobs for c in children] == [2, None, None]
    assert all(c.sampling.logprobs == 1 and c.sampling.temperature == 0.5 for c in children)
    assert all(c.prompt_token_ids == [1, 2, 3] and c.priority == 1 and c.eos_token_ids == [2] for c in children)
    unseeded = fan_out(add_request(n=2))
    assert [c.sampling.seed for c in unseeded] == [None, None]


def test_outputs_of_the_children_merge_into_one_request_output(tok):
    processor = OutputProcessor(tok)
    core = processor.add_request(add_request(n=2, max_tokens=5), "prompt")
    assert [m.request_id for m in core] == ["0_r", "1_r"]
    hi, there = tok.encode("Hi", add_special_tokens=False)[0], tok.encode(" there", add_special_tokens=False)[0]

    (output,), _ = processor.process([TokenDelta("1_r", [there]), TokenDelta("0_r", [hi])])
    assert output.request_id == "r" and not output.finished
    assert [(c.index, c.text) for c in output.outputs] == [(0, "Hi"), (1, " there")]

    (output,), _ = processor.process([TokenDelta("0_r", [there], finish_reason="length")])
    assert output.outputs[0].finish_reason == "length" and output.outputs[1].finish_reason is None
    assert not output.finished and processor.has_unfinished()
    assert processor.core_request_ids("r") == ["1_r"]

    (output,), _ = processor.process([TokenDelta("1_r", [2], finish_reason="stop", num_cached_tokens=16)])
    assert output.finished and output.num_cached_tokens == 16
    assert [c.text for c in output.outputs] == ["Hi there", " there"]
    assert [c.token_ids for c in output.outputs] == [[hi, there], [there, 2]]
    assert not processor.has_unfinished()


def test_a_stop_string_ends_only_its_own_completion(tok):
    processor = OutputProcessor(tok)
    processor.add_request(add_request(n=2, max_tokens=20, stop="END"), None)
    ids = tok.encode("go END more", add_special_tokens=False)
    outputs, to_abort = processor.process([TokenDelta("0_r", ids), TokenDelta("1_r", ids[:1])])
    assert to_abort == ["0_r"]
    assert outputs[0].outputs[0].finish_reason == "stop" and outputs[0].outputs[1].finish_reason is None
    assert processor.process([TokenDelta("0_r", ids[:1])]) == ([], [])  # the core had not seen the abort yet


def test_abort_finishes_every_completion_and_forgets_the_request(tok):
    processor = OutputProcessor(tok)
    processor.add_request(add_request(n=3), None)
    processor.process([TokenDelta("2_r", [5], finish_reason="length")])
    assert processor.core_request_ids("r") == ["0_r", "1_r"]
    output = processor.abort("r")
    assert [c.finish_reason for c in output.outputs] == ["abort", "abort", "length"]
    assert processor.request_id_of("0_r") is None and not processor.has_unfinished()
    assert processor.process([TokenDelta("0_r", [5])]) == ([], [])


def test_ids_in_use_are_refused_without_tracking_anything(tok):
    processor = OutputProcessor(tok)
    processor.add_request(add_request("x", n=2), None)
    for clash in (add_request("x"), add_request("0_x"), add_request("1_x", n=1)):
        with pytest.raises(ValueError, match="^request_id:"):
            processor.add_request(clash, None)
    assert processor.core_request_ids("x") == ["0_x", "1_x"]


def test_logprob_rows_become_vllm_dicts(tok):
    processor = OutputProcessor(tok)
    processor.add_request(add_request(logprobs=2, prompt_logprobs=1), None)
    a, b, c = (tok.encode(w, add_special_tokens=False)[0] for w in (" a", " b", " c"))
    # The sampled token (c) is not in the top 2; then it is the top token.
    rows = TokenLogprobs([[c, a, b], [a, a, b]], [[-3.0, -0.5, -1.0], [-0.25, -0.25, -2.0]], [7, 1])
    prompt_rows = TokenLogprobs([[2, 9], [3, 3]], [[-4.0, -0.1], [-0.2, -0.2]], [12, 1])
    (output,), _ = processor.process([TokenDelta("r", [c, a], logprobs=rows, prompt_logprobs=prompt_rows)])
    completion = output.outputs[0]
    assert completion.logprobs == [
        {c: Logprob(-3.0, 7, " c"), a: Logprob(-0.5, 1, " a"), b: Logprob(-1.0, 2, " b")},
        {a: Logprob(-0.25, 1, " a"), b: Logprob(-2.0, 2, " b")},
    ]
    assert list(completion.logprobs[0]) == [c, a, b]  # the chosen token first, as in vLLM
    assert completion.cumulative_logprob == pytest.approx(-3.25)
    assert output.prompt_logprobs == [
        None,
        {2: Logprob(-4.0, 12, tok.decode([2])), 9: Logprob(-0.1, 1, tok.decode([9]))},
        {3: Logprob(-0.2, 1, tok.decode([3]))},
    ]


def test_logprobs_without_detokenize_have_no_decoded_tokens(tok):
    processor = OutputProcessor(tok)
    processor.add_request(add_request(logprobs=0, detokenize=False), None)
    (output,), _ = processor.process([TokenDelta("r", [5], logprobs=TokenLogprobs([[5]], [[-1.5]], [3]))])
    assert output.outputs[0].logprobs == [{5: Logprob(-1.5, 3, None)}] and output.outputs[0].text == ""
