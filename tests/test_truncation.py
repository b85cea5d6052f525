"""truncate_prompt_tokens (vLLM's: keep a prompt's last k tokens; -1: max_model_len), offline and
over HTTP, each call compared with the untruncated call on the truncated input: a text re-read by
the tokenizer's own left truncation (its [CLS] / [SEP] kept, as vLLM's tokenizer call keeps them),
token ids sliced, a cross-encoder's pair truncated longest-first; embeddings, classes and scores
of tiny random BERTs (transformers-made, with MiniLM's WordPiece tokenizer), greedy tokens of a
tiny Llama; and the values refused at the edge (0, below -1, over max_model_len)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.helpers.models import save_tiny_model
from tests.helpers.pooling import save_tiny_encoder
from tests.helpers.server import ONE_THREAD, start_server
from zllm import LLM, PoolingParams, SamplingParams

MAX_LEN = 64
WORDS = "the cat sat on the mat while a dog ran in the park and birds sang over the old river bank".split()
LONG = " ".join(WORDS * 2)  # 42 words, each one WordPiece token: 44 tokens with [CLS] and [SEP]
TEXTS = [LONG, " ".join(WORDS[:5]), " ".join(reversed(WORDS))]
QUERY = "where did the cat sit"


def _left_truncating_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, truncation_side="left")


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return save_tiny_encoder(tmp_path_factory.mktemp("bert"), "BertModel")


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return save_tiny_encoder(tmp_path_factory.mktemp("bert-ce"), "BertForSequenceClassification", num_labels=1)


# ---- offline ------------------------------------------------------------------------------------


def test_embeddings_of_truncated_texts_and_ids_equal_those_of_the_truncated_input(encoder_dir):
    tokenizer = _left_truncating_tokenizer(encoder_dir)
    expected = [tokenizer(t, truncation=True, max_length=12)["input_ids"] for t in TEXTS]
    assert expected[0][0] == tokenizer.cls_token_id and len(expected[0]) == 12  # [CLS] kept, the start dropped
    long_ids = tokenizer(LONG)["input_ids"]
    with LLM(str(encoder_dir), device="cpu", max_model_len=MAX_LEN) as llm:
        truncated = llm.embed(TEXTS, truncate_prompt_tokens=12, use_tqdm=False)
        reference = llm.embed([{"prompt_token_ids": ids} for ids in expected], use_tqdm=False)
        assert [o.prompt_token_ids for o in truncated] == expected
        assert np.allclose([o.outputs.embedding for o in truncated], [o.outputs.embedding for o in reference])
        # Token ids are sliced (the caller's ids are taken as they are), through encode's params too.
        params = PoolingParams(task="encode", truncate_prompt_tokens=7)
        (sliced,) = llm.encode({"prompt_token_ids": long_ids}, pooling_params=params, use_tqdm=False)
        (direct,) = llm.encode({"prompt_token_ids": long_ids[-7:]}, use_tqdm=False)
        assert sliced.prompt_token_ids == long_ids[-7:]
        assert np.allclose(sliced.outputs.data, direct.outputs.data)
        # -1: max_model_len; an input over it runs truncated instead of being refused.
        too_long = " ".join(WORDS * 4)
        with pytest.raises(ValueError, match=r"input: 86 tokens exceed the model.s maximum of 64"):
            llm.embed(too_long, use_tqdm=False)
        (whole,) = llm.embed(too_long, truncate_prompt_tokens=-1, use_tqdm=False)
        assert whole.prompt_token_ids == tokenizer(too_long, truncation=True, max_length=MAX_LEN)["input_ids"]
        for bad, reason in ((0, "must be an integer >= 1 or -1"), (-2, "must be an integer >= 1 or -1")):
            with pytest.raises(ValueError, match=f"truncate_prompt_tokens: {reason}"):
                llm.embed(LONG, truncate_prompt_tokens=bad, use_tqdm=False)
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens: 65 exceeds the model's max_model_len \(64\)"):
            llm.embed(LONG, truncate_prompt_tokens=MAX_LEN + 1, use_tqdm=False)


def test_cross_encoder_scores_and_classes_of_truncated_inputs(cross_encoder_dir):
    tokenizer = _left_truncating_tokenizer(cross_encoder_dir)
    pairs = [tokenizer(QUERY, t, truncation=True, max_length=16) for t in TEXTS]
    assert pairs[0]["input_ids"][:7] == tokenizer(QUERY)["input_ids"][:7]  # the longer text lost its start
    singles = [tokenizer(t, truncation=True, max_length=10)["input_ids"] for t in TEXTS]
    with LLM(str(cross_encoder_dir), device="cpu", max_model_len=MAX_LEN) as llm:
        scores = llm.score(QUERY, TEXTS, truncate_prompt_tokens=16, use_tqdm=False)
        reference = llm.classify(
            [{"prompt_token_ids": p["input_ids"], "token_type_ids": p["token_type_ids"]} for p in pairs],
            use_tqdm=False,
        )
        assert [s.prompt_token_ids for s in scores] == [p["input_ids"] for p in pairs]
        assert np.allclose([s.outputs.score for s in scores], [r.outputs.probs[0] for r in reference])
        classes = llm.classify(TEXTS, truncate_prompt_tokens=10, use_tqdm=False)
        direct = llm.classify([{"prompt_token_ids": ids} for ids in singles], use_tqdm=False)
        assert np.allclose([c.outputs.probs for c in classes], [d.outputs.probs for d in direct])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    model_dir = save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(model_dir)
    return model_dir


PROMPT_IDS = list(range(3, 40))


def test_generation_of_a_truncated_prompt_equals_that_of_its_last_tokens(llama_dir):
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(llama_dir), device="cpu", max_model_len=MAX_LEN, kv_cache_memory_bytes=8 << 20) as llm:
        (truncated,) = llm.generate(
            {"prompt_token_ids": PROMPT_IDS}, SamplingParams(truncate_prompt_tokens=9, **greedy), use_tqdm=False
        )
        (direct,) = llm.generate({"prompt_token_ids": PROMPT_IDS[-9:]}, SamplingParams(**greedy), use_tqdm=False)
    assert truncated.prompt_token_ids == PROMPT_IDS[-9:]
    assert truncated.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens: must be an integer >= 1 or -1"):
        SamplingParams(truncate_prompt_tokens=0)


# ---- over HTTP ----------------------------------------------------------------------------------


def _server(tmp_path_factory, name: str, model_dir):
    directory = tmp_path_factory.mktemp(name)
    return start_server(directory, str(model_dir), "--max-model-len", str(MAX_LEN), "--device", "cpu", env=ONE_THREAD)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, encoder_dir, cross_encoder_dir, llama_dir):
    handles = {}
    try:
        for name, model_dir in (("embed", encoder_dir), ("cross", cross_encoder_dir), ("llama", llama_dir)):
            handles[name] = _server(tmp_path_factory, name, model_dir)
        yield handles
    finally:
        for handle in handles.values():
            handle.stop()


def _post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _refused(url: str, path: str, body: dict) -> None:
    for bad in (0, -2, MAX_LEN + 1):
        response = httpx.post(url + path, json={**body, "truncate_prompt_tokens": bad}, timeout=60)
        assert response.status_code == 400, (path, bad, response.text)
        assert response.json()["error"]["param"] == "truncate_prompt_tokens"


def test_http_embeddings_of_truncated_inputs(servers, encoder_dir):
    url, tokenizer = servers["embed"].http_url, _left_truncating_tokenizer(encoder_dir)
    expected = [tokenizer(t, truncation=True, max_length=12)["input_ids"] for t in TEXTS]
    truncated = _post(url, "/v1/embeddings", {"input": TEXTS, "truncate_prompt_tokens": 12})
    direct = _post(url, "/v1/embeddings", {"input": expected})
    assert truncated["usage"]["prompt_tokens"] == sum(map(len, expected))
    vectors = [[d["embedding"] for d in r["data"]] for r in (truncated, direct)]
    assert np.allclose(*vectors, atol=1e-6)
    long_ids = tokenizer(LONG)["input_ids"]
    sliced = _post(url, "/v1/embeddings", {"input": [long_ids], "truncate_prompt_tokens": -1})
    assert sliced["usage"]["prompt_tokens"] == len(long_ids)  # under max_model_len: nothing cut
    _refused(url, "/v1/embeddings", {"input": TEXTS})


def test_http_scores_reranks_and_classes_of_truncated_inputs(servers, cross_encoder_dir):
    url, tokenizer = servers["cross"].http_url, _left_truncating_tokenizer(cross_encoder_dir)
    # The truncated pairs as texts: every word is one token, so decoding the kept ids gives a text
    # that tokenizes back to exactly them.
    pairs = [tokenizer(QUERY, t, truncation=True, max_length=16) for t in TEXTS]
    kept = [_pair_texts(tokenizer, p) for p in pairs]
    for (query, document), pair in zip(kept, pairs):
        assert tokenizer(query, document)["input_ids"] == pair["input_ids"]
    truncated = _post(url, "/score", {"text_1": QUERY, "text_2": TEXTS, "truncate_prompt_tokens": 16})
    direct = _post(url, "/score", {"text_1": [q for q, _ in kept], "text_2": [d for _, d in kept]})
    assert np.allclose([d["score"] for d in truncated["data"]], [d["score"] for d in direct["data"]], atol=1e-6)
    reranked = _post(url, "/rerank", {"query": QUERY, "documents": TEXTS, "truncate_prompt_tokens": 16})
    by_index = {r["index"]: r["relevance_score"] for r in reranked["results"]}
    assert np.allclose([by_index[i] for i in range(len(TEXTS))], [d["score"] for d in direct["data"]], atol=1e-6)
    classes = _post(url, "/classify", {"input": TEXTS, "truncate_prompt_tokens": 10})
    short = [tokenizer.decode(tokenizer(t, truncation=True, max_length=10)["input_ids"][1:-1]) for t in TEXTS]
    direct_classes = _post(url, "/classify", {"input": short})
    assert np.allclose([d["probs"] for d in classes["data"]], [d["probs"] for d in direct_classes["data"]], atol=1e-6)
    from zllm import Client

    with Client(servers["cross"].endpoint) as client:  # the Python ZMQ client: the same truncation
        assert client.score(QUERY, TEXTS[0], truncate_prompt_tokens=16).outputs.score == pytest.approx(
            direct["data"][0]["score"], abs=1e-6
        )
        assert client.classify(TEXTS[0], truncate_prompt_tokens=10).outputs.probs == pytest.approx(
            direct_classes["data"][0]["probs"], abs=1e-6
        )
    _refused(url, "/score", {"text_1": QUERY, "text_2": TEXTS})
    _refused(url, "/rerank", {"query": QUERY, "documents": TEXTS})
    _refused(url, "/classify", {"input": TEXTS})


def _pair_texts(tokenizer, encoded) -> tuple[str, str]:
    ids, types = encoded["input_ids"], encoded["token_type_ids"]
    first = [i for i, t in zip(ids, types) if t == 0]
    second = [i for i, t in zip(ids, types) if t == 1]
    return tokenizer.decode(first[1:-1]), tokenizer.decode(second[:-1])


def test_http_completions_and_chat_of_truncated_prompts(servers):
    url = servers["llama"].http_url
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    truncated = _post(url, "/v1/completions", {"prompt": PROMPT_IDS, "truncate_prompt_tokens": 9, **greedy})
    direct = _post(url, "/v1/completions", {"prompt": PROMPT_IDS[-9:], **greedy})
    assert truncated["usage"]["prompt_tokens"] == 9
    assert truncated["choices"][0]["text"] == direct["choices"][0]["text"]
    messages = [{"role": "user", "content": " ".join(f"t{i}" for i in PROMPT_IDS)}]
    rendered = _post(url, "/tokenize", {"messages": messages})["tokens"]
    chat = _post(url, "/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": 9, **greedy})
    by_ids = _post(url, "/v1/completions", {"prompt": rendered[-9:], **greedy})
    assert chat["usage"]["prompt_tokens"] == 9
    assert chat["choices"][0]["message"]["content"] == by_ids["choices"][0]["text"]
    _refused(url, "/v1/completions", {"prompt": PROMPT_IDS, **greedy})
    _refused(url, "/v1/chat/completions", {"messages": messages, **greedy})
