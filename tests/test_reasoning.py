"""Reasoning parsers (--reasoning-parser): the thinking split from the answer exactly at the tags,
whole and streamed; chat_template_kwargs reaching the template. The parsers alone, then through a
real `vllm-launch` on a tiny random Qwen3 checkpoint whose chat template opens a `<think>` (as
Qwen3-Thinking's does) unless `enable_thinking` is false."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.models import save_tiny_model
from tests.helpers.server import ONE_THREAD, start_server
from zllm.config import REASONING_PARSERS as CONFIG_NAMES
from zllm.frontend.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStream, reasoning_parser

THINK, END = "<think>", "</think>"


# ---- the parsers alone ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "prompt", "output", "reasoning", "content"),
    [
        ("deepseek_r1", "Q: ", "<think>a b</think> c", "a b", " c"),
        ("deepseek_r1", "Q: <think>", "a b</think>c</think>", "a b", "c</think>"),
        ("deepseek_r1", "Q: ", "never closed", "never closed", ""),
        ("qwen3", "Q: ", "<think>\nx\n</think>\n\ny", "\nx\n", "\n\ny"),
        ("qwen3", "Q: <think>\n", "x</think>y", "x", "y"),
        ("qwen3", "Q: ", "no thinking here", None, "no thinking here"),
        ("qwen3", "Q: <think></think>", "y </think>", None, "y </think>"),  # thinking closed in the prompt
    ],
)
def test_split_is_exactly_at_the_tags(name, prompt, output, reasoning, content):
    split = reasoning_parser(name, prompt).split(output, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("prompt", ["Q: ", "Q: <think>"])
@pytest.mark.parametrize("output", ["<think>ab</think>cd", "a<b</th</think>x<", "<thin", "plain", "<think>x"])
def test_streamed_parts_concatenate_to_the_whole_split(name, prompt, output):
    whole = reasoning_parser(name, prompt).split(output, final=True)
    for size in (1, 2, 3):
        stream = ReasoningStream(reasoning_parser(name, prompt))
        pieces = [output[i : i + size] for i in range(0, len(output), size)]
        fed = [stream.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert "".join(r for r, _ in fed) == (whole.reasoning or "")
        assert "".join(c for _, c in fed) == whole.content


def test_one_list_of_names_for_registry_config_cli_and_docs():
    from zllm.launch.cli import build_parser

    (action,) = [a for a in build_parser()._actions if a.dest == "reasoning_parser"]
    assert sorted(REASONING_PARSERS) == sorted(CONFIG_NAMES) == sorted(action.choices)
    api_doc = (Path(__file__).parents[1] / "docs/api.md").read_text()
    documented = re.search(r"--reasoning-parser \{([^}]*)\}", api_doc).group(1).split(",")
    assert sorted(documented) == sorted(REASONING_PARSERS)


def test_an_unknown_parser_is_refused_when_configured():
    from zllm.config import EngineConfig

    with pytest.raises(ValueError, match="^reasoning_parser"):
        EngineConfig(model="m", max_model_len=64, reasoning_parser="nope").validate()


# ---- through a server -----------------------------------------------------------------------------

# Word-level placeholder vocabulary t0..t255 (tests/helpers/models.py), plus the two tags.
TEMPLATE = (
    "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}"
    "{% if add_generation_prompt %}t5 {% if enable_thinking is defined and not enable_thinking %}"
    "<think> </think> {% else %}<think> {% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from benchmarks.dummy_model import write_placeholder_tokenizer

    directory = save_tiny_model(
        tmp_path_factory.mktemp("qwen3"), "qwen3", vocab_size=272, max_position_embeddings=4096, head_dim=16
    )
    write_placeholder_tokenizer(directory, 256)  # t0..t255, then the tags at 256 and 257
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens([THINK, END])  # not special: they stay in the text, as Qwen3's do
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def api(tmp_path_factory, qwen3_dir):
    handle = start_server(
        tmp_path_factory.mktemp("reasoning"), str(qwen3_dir), "--reasoning-parser", "qwen3", env=ONE_THREAD
    )
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "t10 t11 t12"}]
# Sampling that writes </think> now and then: a bias on the tag's id, a fixed seed.
SAMPLING = dict(max_tokens=64, temperature=1.0, seed=7)


def _raw(api, client, end_id: int, **template_kwargs) -> tuple[str, str]:
    """The rendered prompt and the raw completion text of the same tokens (seeded sampling)."""
    body = {"messages": MESSAGES, "chat_template_kwargs": template_kwargs}
    tokens = httpx.post(f"{api.http_url}/tokenize", json=body).json()["tokens"]
    prompt = httpx.post(f"{api.http_url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    raw = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=tokens,
        logit_bias={str(end_id): 3.0},
        extra_body={"ignore_eos": True},
        **SAMPLING,
    )
    return prompt, raw.choices[0].text


def _end_id(qwen3_dir) -> int:
    vocab = json.loads((qwen3_dir / "tokenizer.json").read_text())
    return next(t["id"] for t in vocab["added_tokens"] if t["content"] == END)


def _chat(client, end_id: int, stream: bool, **template_kwargs):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        logit_bias={str(end_id): 3.0},
        stream=stream,
        extra_body={"ignore_eos": True, "chat_template_kwargs": template_kwargs},
        **SAMPLING,
    )


def test_chat_splits_the_thinking_at_the_tag_whole_and_streamed(api, client, qwen3_dir):
    end_id = _end_id(qwen3_dir)
    prompt, raw = _raw(api, client, end_id)
    assert prompt.rstrip().endswith(THINK)
    assert END in raw and raw.index(END) > 0 and raw.split(END, 1)[1].strip(), raw  # it thinks, then answers
    reasoning, content = raw.split(END, 1)

    message = _chat(client, end_id, stream=False).choices[0].message
    assert message.reasoning_content == message.model_extra["reasoning"] == reasoning
    assert message.content == (content or None)

    chunks = list(_chat(client, end_id, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    assert (streamed_reasoning, streamed_content) == (reasoning, content)


def test_enable_thinking_false_reaches_the_template_and_all_is_answer(api, client, qwen3_dir):
    end_id = _end_id(qwen3_dir)
    prompt, raw = _raw(api, client, end_id, enable_thinking=False)
    assert prompt.rstrip().endswith(END)  # the template closed the thinking itself
    message = _chat(client, end_id, stream=False, enable_thinking=False).choices[0].message
    assert message.reasoning_content is None and message.content == raw


def test_bad_chat_template_kwargs_are_a_400(api):
    for kwargs in ({"chat_template": "{{ 1 }}"}, "not an object"):
        response = httpx.post(
            f"{api.http_url}/v1/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": kwargs}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template_kwargs"


# ---- structured outputs constrain the answer only -------------------------------------------------


class _OnlyDigits:
    """A stand-in xgrammar matcher: allows tokens below 10, never terminates."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        if token_id >= 10:
            return False
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False

    def rollback(self, count: int) -> None:
        del self.accepted[len(self.accepted) - count :]


def test_the_engine_grammar_sleeps_until_the_end_of_thinking():
    from concurrent.futures import Future

    from zllm.enginecore.structured_outputs import RequestGrammar

    grammar = RequestGrammar(Future(), matcher=_OnlyDigits(), starts_after=[50, 51])
    assert not grammar.is_active and grammar.valid_drafts([40, 50, 51, 99]) == [40, 50]  # up to the waking one
    for token in (40, 51, 50, 42, 50):  # thinking: anything goes, a lone 50 or 51 is no end
        assert grammar.accept(token) and not grammar.is_active
    assert grammar.accept(51) and grammar.is_active  # ... 50, 51: the answer starts
    assert grammar.matcher.accepted == []
    assert not grammar.accept(99) and grammar.accept(3) and grammar.matcher.accepted == [3]


def test_the_gate_travels_as_a_sampling_field():
    from zllm.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"], starts_after=[7]))
    assert params.structured_outputs.grammar_spec() == StructuredOutputsParams(choice=["a"]).grammar_spec()
    with pytest.raises(ValueError, match="starts_after"):
        StructuredOutputsParams(choice=["a"], starts_after=[])


def test_a_constrained_answer_follows_free_thinking(api, client, qwen3_dir):
    end_id = _end_id(qwen3_dir)
    _, raw = _raw(api, client, end_id)
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        logit_bias={str(end_id): 3.0},
        extra_body={"structured_outputs": {"choice": ["t7", "t9"]}},
        **SAMPLING,
    )
    message = answer.choices[0].message
    # The thinking ran free: the same seeded tokens as without a constraint (a grammar from the
    # first token would have forced t7 or t9 at once) ...
    assert message.reasoning_content == raw.split(END, 1)[0]
    # ... and the answer after </think> is exactly one of the choices, which ends it.
    assert message.content.strip() in ("t7", "t9") and answer.choices[0].finish_reason == "stop", message


# ---- the Responses and Messages APIs carry the thinking too ---------------------------------------


def test_responses_have_a_reasoning_item_whole_and_streamed(api, client, qwen3_dir):
    end_id = _end_id(qwen3_dir)
    _, raw = _raw(api, client, end_id)
    reasoning, content = raw.split(END, 1)
    ask = dict(
        model=client.models.list().data[0].id,
        input=MESSAGES[0]["content"],
        max_output_tokens=SAMPLING["max_tokens"],
        temperature=1.0,
        extra_body={"seed": 7, "logit_bias": {str(end_id): 3.0}},
    )
    response = client.responses.create(**ask)
    thought, message = response.output
    assert thought.type == "reasoning" and thought.content[0].text == reasoning
    assert message.type == "message" and response.output_text == content

    events = list(client.responses.create(**ask, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]


def test_anthropic_messages_have_a_thinking_block(api, client, qwen3_dir):
    import anthropic

    end_id = _end_id(qwen3_dir)
    claude = anthropic.Anthropic(base_url=api.http_url, api_key="unused", max_retries=0, timeout=120)
    message = claude.messages.create(
        model=client.models.list().data[0].id,
        max_tokens=SAMPLING["max_tokens"],
        messages=MESSAGES,
        extra_body={"temperature": 1.0, "seed": 7, "logit_bias": {str(end_id): 3.0}},
    )
    _, raw = _raw(api, client, end_id)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == raw.split(END, 1)[0]
    assert text.type == "text" and text.text == raw.split(END, 1)[1]


def test_include_reasoning_false_drops_the_thinking(api, client, qwen3_dir):
    end_id = _end_id(qwen3_dir)
    _, raw = _raw(api, client, end_id)
    answer = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        logit_bias={str(end_id): 3.0},
        extra_body={"ignore_eos": True, "include_reasoning": False},
        **SAMPLING,
    )
    assert answer.choices[0].message.reasoning_content is None
    assert answer.choices[0].message.content == raw.split(END, 1)[1]


def test_llm_chat_passes_chat_template_kwargs(qwen3_dir):
    from zllm import LLM, SamplingParams

    with LLM(str(qwen3_dir), dtype="float32", max_model_len=256) as llm:
        params = SamplingParams(max_tokens=1)
        thinking = llm.chat(MESSAGES, params, use_tqdm=False)[0].prompt
        plain = llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0].prompt
    assert thinking.rstrip().endswith(THINK) and plain.rstrip().endswith(END)
