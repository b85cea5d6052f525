"""Streaming detokenization and the output processor's stop-string / EOS handling.

(a) the real SmolLM2 tokenizer (byte-level BPE): multi-byte characters split over tokens;
(b) a Llama-2-style byte-fallback tokenizer built here with the `tokenizers` library;
(c) OutputProcessor fed TokenDelta messages one token at a time.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from zllm.frontend.detokenizer import IncrementalDetokenizer
from zllm.frontend.output_processor import OutputProcessor
from zllm.ipc.messages import AddRequest, TokenDelta
from zllm.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

MULTIBYTE_TEXTS = [
    "Héllo wörld — naïve café, façade, Ærøskøbing",
    "日本語のテキストと中文字符，한국어도",
    "Emoji 🎉👍🏽 and a family 👨\u200d👩\u200d👧 🇫🇷",
    "Combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323 done",
    "Mixed ascii, Ελληνικά, кириллица and math ∑∫√ ≠ ≤",
]


# ---- helpers ----------------------------------------------------------------------------------


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The pieces IncrementalDetokenizer emits for output_ids, one token at a time."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    pieces = [detokenizer.add_token(token_id) for token_id in output_ids]
    assert detokenizer.text == "".join(pieces)
    return pieces


def assert_clean(pieces: list[str]) -> None:
    for piece in pieces:
        assert isinstance(piece, str)
        assert REPLACEMENT_CHAR not in piece, pieces


def continuation(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    """What the output adds to the full decode: decode(prompt + output) minus decode(prompt),
    special tokens skipped (as the detokenizer does by default)."""
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    prefix = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(prefix)
    return full[len(prefix) :]


# ---- (a) SmolLM2: byte-level BPE ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_byte_level_stream_without_prompt_equals_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, [], ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert_clean(pieces)
    if any(REPLACEMENT_CHAR in tok.decode([token_id]) for token_id in ids):
        assert "" in pieces  # a token holding part of a character emits nothing until it is complete


def test_multibyte_texts_really_split_characters(tok):
    # Guard for the test above: most texts do put characters' bytes in several tokens.
    split = [
        text
        for text in MULTIBYTE_TEXTS
        if any(REPLACEMENT_CHAR in tok.decode([i]) for i in tok.encode(text, add_special_tokens=False))
    ]
    assert len(split) >= 3, split


PROMPTS = [
    "A prompt that is longer than the six context tokens the detokenizer keeps, ending in a word",
    "Short",
    "Ends with a newline\n",
    "Party 🎉👍🏽",  # the context window starts in the middle of an emoji's bytes
    "x 日本語",  # likewise, inside a CJK character
]
CONTINUATIONS = [" and then 日本語", " 🎉 ok", "é café", "\nnew line", "語 done", ", naïve"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_byte_level_stream_with_prompt_equals_decode_continuation(tok, prompt):
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    for text in CONTINUATIONS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = stream(tok, prompt_ids, ids)
        assert "".join(pieces) == continuation(tok, prompt_ids, ids), (prompt, text)
        assert_clean(pieces)


def test_byte_level_stream_after_chat_template_prompt(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    ids = tok.encode("Sure! Voilà 🎉", add_special_tokens=False)
    pieces = stream(tok, prompt_ids, ids)
    assert "".join(pieces) == "Sure! Voilà 🎉"
    assert_clean(pieces)


def test_special_tokens_skipped_or_shown(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hello", add_special_tokens=False) + [eos] + tok.encode(" world", add_special_tokens=False)
    assert "".join(stream(tok, [], ids, skip_special_tokens=True)) == "Hello world"
    assert "".join(stream(tok, [], ids, skip_special_tokens=False)) == "Hello<|im_end|> world"


# ---- (b) byte-fallback BPE (Llama-2 style) -------------------------------------------------------


BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
SPECIAL = ["<unk>", "<s>", "</s>"]
ASCII_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-") + ["▁"]
MERGES = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"), ("o", "r"), ("▁", "t")]


@pytest.fixture(scope="module")
def byte_fallback_tok() -> PreTrainedTokenizerFast:
    """Only ASCII in the vocabulary: every other character falls back to its UTF-8 byte tokens."""
    vocab_list = SPECIAL + BYTE_TOKENS + ASCII_CHARS + ["".join(pair) for pair in MERGES]
    vocab = {token: i for i, token in enumerate(vocab_list)}
    model = models.BPE(vocab=vocab, merges=MERGES, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


BYTE_FALLBACK_TEXTS = [
    "hello world",
    "héllo wörld",
    "hello 日本 🎉 done",
    "ÿ€ then e\u0301 and 👨\u200d👩\u200d👧!",
    "🎉🎉 leading emoji",
]


@pytest.mark.parametrize("text", BYTE_FALLBACK_TEXTS)
def test_byte_fallback_stream_equals_decode(byte_fallback_tok, text):
    tok = byte_fallback_tok
    ids = tok.encode(text, add_special_tokens=False)
    if not text.isascii():
        assert any(token in BYTE_TOKENS for token in tok.convert_ids_to_tokens(ids))
    pieces = stream(tok, [], ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert_clean(pieces)


BYTE_FALLBACK_PROMPTS = {
    "words": lambda tok: tok.encode("hello there", add_special_tokens=False),
    "bos-only": lambda tok: [tok.bos_token_id],
    "bos-words": lambda tok: [tok.bos_token_id] + tok.encode("hello there", add_special_tokens=False),
    # the six context tokens start inside the byte tokens of a character
    "bytes": lambda tok: tok.encode("hello 日本語!", add_special_tokens=False),
}


@pytest.mark.parametrize("prompt", BYTE_FALLBACK_PROMPTS)
@pytest.mark.parametrize("text", BYTE_FALLBACK_TEXTS)
def test_byte_fallback_stream_with_prompt_equals_decode_continuation(byte_fallback_tok, prompt, text):
    tok = byte_fallback_tok
    prompt_ids = BYTE_FALLBACK_PROMPTS[prompt](tok)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, prompt_ids, ids)
    assert "".join(pieces) == continuation(tok, prompt_ids, ids)
    assert_clean(pieces)
    if prompt == "words":
        assert "".join(pieces) == " " + text  # the SentencePiece leading space is kept in context


# ---- (c) OutputProcessor: stop strings, EOS, special tokens ------------------------------------


EOS_ID = 2  # <|im_end|>


def one_token_deltas(request_id: str, ids: list[int]) -> list[TokenDelta]:
    return [TokenDelta(request_id, [token_id]) for token_id in ids]


def feed(processor: OutputProcessor, deltas: list[TokenDelta]):
    """Process deltas one call at a time; return the last output and every to_abort id."""
    last, aborted = None, []
    for delta in deltas:
        outputs, to_abort = processor.process([delta])
        aborted.extend(to_abort)
        if outputs:
            last = outputs[-1]
    return last, aborted


def track(processor: OutputProcessor, request_id: str, prompt: str | None, prompt_ids: list[int], sampling) -> None:
    processor.add_request(AddRequest(request_id, prompt_ids, sampling, 0.0), prompt)


def new_processor(tok, sampling: SamplingParams, request_id: str = "r0", prompt: str = "Say hi:") -> OutputProcessor:
    processor = OutputProcessor(tok)
    track(processor, request_id, prompt, tok.encode(prompt, add_special_tokens=False), sampling)
    return processor


STOP_TEXT = "Hello world, this is the end. More text follows."


def test_stop_string_spanning_two_tokens_cuts_and_aborts(tok):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    stop = "lo wor"  # spans "Hello" and " world"
    assert tok.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    processor = new_processor(tok, SamplingParams(max_tokens=50, stop=[stop]))
    output, aborted = feed(processor, one_token_deltas("r0", ids))
    completion = output.outputs[0]
    assert completion.text == "Hel"
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert output.finished
    assert aborted == ["r0"]
    assert completion.token_ids == ids[:2]  # nothing after the token that completed the stop string
    assert not processor.has_unfinished()


def test_stop_string_included_when_asked(tok):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    processor = new_processor(tok, SamplingParams(max_tokens=50, stop=["lo wor"], include_stop_str_in_output=True))
    output, aborted = feed(processor, one_token_deltas("r0", ids))
    assert output.outputs[0].text == "Hello wor"
    assert output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].stop_reason == "lo wor"
    assert aborted == ["r0"]


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    # Both complete on the token " end"; "the end" starts earlier in the text, so it is the match.
    processor = new_processor(tok, SamplingParams(max_tokens=50, stop=["end", "the end"]))
    output, aborted = feed(processor, one_token_deltas("r0", ids))
    assert output.outputs[0].text == "Hello world, this is "
    assert output.outputs[0].stop_reason == "the end"
    assert aborted == ["r0"]


def test_stop_string_inside_a_multi_token_delta(tok):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    processor = new_processor(tok, SamplingParams(max_tokens=50, stop=["end."]))
    outputs, to_abort = processor.process([TokenDelta("r0", ids)])
    assert outputs[0].outputs[0].text == "Hello world, this is the "
    assert outputs[0].outputs[0].finish_reason == "stop"
    assert to_abort == ["r0"]
    # Tokens the core produced before it saw the abort are dropped.
    assert processor.process([TokenDelta("r0", ids[:2])]) == ([], [])


def test_stop_string_and_core_finish_on_the_same_delta_is_not_aborted(tok):
    ids = tok.encode(STOP_TEXT, add_special_tokens=False)
    processor = new_processor(tok, SamplingParams(max_tokens=2, stop=["lo wor"]))
    deltas = [TokenDelta("r0", [ids[0]]), TokenDelta("r0", [ids[1]], finish_reason="length")]
    output, aborted = feed(processor, deltas)
    assert output.outputs[0].text == "Hel"
    assert output.outputs[0].finish_reason == "stop"
    assert aborted == []  # the core already finished it


def test_stop_string_ignored_before_min_tokens(tok):
    ids = tok.encode("Hello world. Hello again.", add_special_tokens=False)
    # Too few tokens for the first "Hello": only the second one, past min_tokens, stops.
    processor = new_processor(tok, SamplingParams(max_tokens=50, stop=["Hello"], min_tokens=3))
    output, aborted = feed(processor, one_token_deltas("r0", ids))
    assert output.outputs[0].text == "Hello world. "
    assert output.outputs[0].finish_reason == "stop"
    assert aborted == ["r0"]


def test_stop_string_with_multibyte_characters(tok):
    text = "Voilà: 日本語のテキスト 🎉 fin"
    ids = tok.encode(text, add_special_tokens=False)
    processor = new_processor(tok, SamplingParams(max_tokens=50, stop=["のテ"]))
    output, aborted = feed(processor, one_token_deltas("r0", ids))
    assert output.outputs[0].text == "Voilà: 日本語"
    assert aborted == ["r0"]


def test_eos_from_core_finishes_without_abort(tok):
    ids = tok.encode("Hi there!", add_special_tokens=False)
    processor = new_processor(tok, SamplingParams(max_tokens=50, stop=["never"]))
    deltas = one_token_deltas("r0", ids) + [TokenDelta("r0", [EOS_ID], finish_reason="stop", stop_reason=EOS_ID)]
    output, aborted = feed(processor, deltas)
    completion = output.outputs[0]
    assert completion.text == "Hi there!"  # skip_special_tokens hides <|im_end|>
    assert completion.token_ids == ids + [EOS_ID]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == EOS_ID
    assert output.finished
    assert aborted == []
    assert not processor.has_unfinished()


def test_special_token_text_shown_without_skip(tok):
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode("Hi", add_special_tokens=False) + [im_start] + tok.encode(" there!", add_special_tokens=False)
    processor = new_processor(tok, SamplingParams(max_tokens=50, skip_special_tokens=False))
    output, _ = feed(processor, one_token_deltas("r0", ids))
    assert output.outputs[0].text == "Hi<|im_start|> there!"


@pytest.mark.parametrize("stop_reason", [None, EOS_ID, 13])  # EOS, EOS as a stop token id, another stop token
@pytest.mark.parametrize("include", [False, True])
def test_the_token_that_stopped_a_completion_is_in_token_ids_but_in_the_text_only_if_asked(tok, stop_reason, include):
    # vLLM: a stop token ends the text unless include_stop_str_in_output; skip_special_tokens=False
    # keeps EOS visible so the rule shows.
    stop_id = EOS_ID if stop_reason is None else stop_reason
    ids = tok.encode("Hi there", add_special_tokens=False)
    params = SamplingParams(max_tokens=50, skip_special_tokens=False, include_stop_str_in_output=include)
    processor = new_processor(tok, params)
    deltas = one_token_deltas("r0", ids) + [TokenDelta("r0", [stop_id], finish_reason="stop", stop_reason=stop_reason)]
    output, _ = feed(processor, deltas)
    completion = output.outputs[0]
    assert completion.token_ids == ids + [stop_id]
    assert completion.text == "Hi there" + (tok.decode([stop_id]) if include else "")


def test_special_tokens_in_the_middle_are_hidden(tok):
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    ids = tok.encode("one", add_special_tokens=False) + [im_start] + tok.encode(" two", add_special_tokens=False)
    processor = new_processor(tok, SamplingParams(max_tokens=50))
    deltas = one_token_deltas("r0", ids) + [TokenDelta("r0", [], finish_reason="length")]
    output, aborted = feed(processor, deltas)
    assert output.outputs[0].text == "one two"
    assert output.outputs[0].finish_reason == "length"
    assert aborted == []


def test_requests_are_tracked_independently(tok):
    processor = OutputProcessor(tok)
    a = tok.encode("Alpha beta STOP gamma", add_special_tokens=False)
    b = tok.encode("Delta epsilon zeta", add_special_tokens=False)
    track(processor, "a", None, [], SamplingParams(max_tokens=50, stop="STOP"))
    track(processor, "b", None, [], SamplingParams(max_tokens=50, stop="STOP"))
    aborted, last = [], {}
    for i in range(max(len(a), len(b))):
        deltas = [TokenDelta(rid, [ids[i]]) for rid, ids in (("a", a), ("b", b)) if i < len(ids)]
        outputs, to_abort = processor.process(deltas)
        aborted.extend(to_abort)
        last.update({o.request_id: o for o in outputs})
    assert aborted == ["a"]
    assert last["a"].outputs[0].text == "Alpha beta "
    assert last["b"].outputs[0].text == "Delta epsilon zeta"
    assert not last["b"].finished
    assert processor.has_unfinished()


def test_invalid_bytes_are_not_swallowed(tok):
    # A model may emit a lone piece of a character; once a complete token follows, the stream
    # catches up with the full decode (U+FFFD where the bytes are invalid) instead of stalling.
    first_byte_of_cjk, continuation_bytes = tok.encode("日本", add_special_tokens=False)[:2]
    ok = tok.encode(" ok", add_special_tokens=False)
    for ids in ([continuation_bytes] + ok, tok.encode("a", add_special_tokens=False) + [first_byte_of_cjk] + ok):
        pieces = stream(tok, [], ids)
        assert "".join(pieces) == tok.decode(ids)
        assert pieces[-1].endswith(" ok")
