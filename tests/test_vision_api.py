"""Images over the OpenAI API and LLM.chat: the official openai client sends a picture as a
base64 data URL to a served tiny Qwen2-VL and gets transformers' greedy answer; a local file
under --allowed-local-media-path gives the same; refusals (an undecodable image, more images than
--limit-mm-per-prompt, a URL that cannot be fetched, a path outside the allowed folder) are 400s
with the reason while the server goes on serving."""

from __future__ import annotations

import base64
import io

import openai
import pytest

from tests.helpers.server import start_server
from tests.helpers.vision import PLACEHOLDER, HFReference, picture, save_tiny_vlm
from zllm import LLM, SamplingParams

MAX_TOKENS = 8
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = save_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")
    return directory, HFReference(directory)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """The folder the server may read images from, with one picture in it."""
    folder = tmp_path_factory.mktemp("media")
    picture(120, 90, 0).save(folder / "landscape.png")
    return folder


@pytest.fixture(scope="module")
def client(tmp_path_factory, model, media):
    handle = start_server(
        tmp_path_factory.mktemp("vision-api"),
        str(model[0]),
        "--max-model-len",
        "1024",
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--allowed-local-media-path",
        str(media),
        env=ONE_THREAD,
    )
    yield openai.OpenAI(base_url=f"{handle.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    handle.stop()


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(client, *urls: str):
    content = [{"type": "text", "text": "t5 t6"}]
    content += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    content.append({"type": "text", "text": "t7"})
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )


def _expected(reference: HFReference, images: list) -> tuple[list[int], list[str]]:
    """transformers' prompt ids and greedy tokens as words (the placeholder tokenizer's word per
    token: the text names the ids)."""
    # The tiny chat template: the content parts joined by newlines, then a space.
    text = "\n".join(["t5 t6", *[PLACEHOLDER] * len(images), "t7"]) + " "
    ids, generated = reference.greedy(text, images, MAX_TOKENS)
    return ids, [f"t{token}" for token in generated]


def test_a_base64_image_gets_transformers_answer(client, model):
    image = picture(120, 90, 0)
    ids, text = _expected(model[1], [image])
    response = _chat(client, data_url(image))
    assert response.choices[0].message.content.split() == text
    assert response.usage.prompt_tokens == len(ids)


def test_a_local_file_under_the_allowed_folder(client, model, media):
    _, text = _expected(model[1], [picture(120, 90, 0)])
    assert _chat(client, f"file://{media / 'landscape.png'}").choices[0].message.content.split() == text


@pytest.mark.parametrize(
    ("urls", "reason"),
    [
        (["data:image/png;base64,aGVsbG8gd29ybGQ="], "cannot be decoded"),
        (["data:image/png;base64,!!!"], "not valid base64"),
        (["data:,"] * 3, "more than the 2 a prompt may carry"),
        (["http://127.0.0.1:9/picture.png"], "cannot fetch"),
        (["file:///etc/hostname"], "outside the allowed media folder"),
        (["/etc/../etc/hostname"], "outside the allowed media folder"),
    ],
    ids=["undecodable", "bad-base64", "too-many", "unfetchable", "outside-folder", "outside-folder-path"],
)
def test_refusals_are_400s_and_the_server_goes_on(client, model, urls, reason):
    with pytest.raises(openai.BadRequestError, match=reason):
        _chat(client, *urls)
    image = picture(60, 200, 1)
    assert _chat(client, data_url(image)).choices[0].message.content.split() == _expected(model[1], [image])[1]


def test_llm_chat_takes_image_parts(model):
    directory, reference = model
    first, second = picture(120, 90, 0), picture(90, 90, 2)
    content = [
        {"type": "text", "text": "t5 t6"},
        {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "image_pil", "image_pil": second},
        {"type": "text", "text": "t7"},
    ]
    with LLM(str(directory), dtype="float32") as llm:
        out = llm.chat(
            [{"role": "user", "content": content}],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            use_tqdm=False,
        )
    ids, text = _expected(reference, [first, second])
    assert (out[0].prompt_token_ids, out[0].outputs[0].text.split()) == (ids, text)


@pytest.fixture(scope="module")
def http_media(media):
    """The media folder served over HTTP on a free local port."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_http_image_is_fetched(client, model, http_media):
    _, text = _expected(model[1], [picture(120, 90, 0)])
    assert _chat(client, f"{http_media}/landscape.png").choices[0].message.content.split() == text
    with pytest.raises(openai.BadRequestError, match="answered HTTP 404"):
        _chat(client, f"{http_media}/missing.png")
