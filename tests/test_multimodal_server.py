"""``/v1/chat/completions`` with ``image_url`` parts, through the official openai client,
on the tiny LLaVA checkpoint: the reply is transformers' greedy continuation of the same
rendered prompt and image; each bad image is a 400 naming what was wrong, after which
the server is idle with every block free and still answers."""

from __future__ import annotations

import httpx
import openai
import pytest
from PIL import Image
from transformers import AutoTokenizer

from server_helpers import MODEL, in_process_app, openai_client, wait_idle
from test_multimodal import GREEDY, data_url, llava, noise_image, oracle  # noqa: F401

__all__ = ["llava", "oracle"]  # the fixtures, shared with the offline tests


@pytest.fixture(scope="module")
def server(llava):  # noqa: F811
    for base_url, _, _ in in_process_app(llava, engine_kwargs={"block_size": 4}):
        yield base_url


def image_message(*urls, text="What is it?"):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_chat_with_an_image_matches_hf(server, llava, oracle):  # noqa: F811
    image = noise_image(40)
    with openai_client(server) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=image_message(data_url(image)), max_tokens=8, temperature=0
        )
    template = AutoTokenizer.from_pretrained(llava, local_files_only=True)
    text = template.apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat is it?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt_ids, expected = oracle(text, [image], add_special_tokens=False)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == template.decode(expected, skip_special_tokens=True)
    assert reply.usage.completion_tokens == len(expected) <= GREEDY.max_tokens


# Made when the test runs (a blank 4097x4097 PNG is a small body, costly to encode).
BAD = {
    "does not decode": lambda: ["data:image/png;base64,aGVsbG8="],
    "network": lambda: ["https://example.com/cat.png"],
    "allowed_local_media_path": lambda: ["/etc/hostname"],
    "limit_mm_per_prompt": lambda: [data_url(noise_image(1)), data_url(noise_image(2))],
    "4097x4097": lambda: [data_url(Image.new("L", (4097, 4097)))],
}


@pytest.mark.parametrize("message", BAD)
def test_a_bad_image_is_a_400_naming_the_cause(server, message):
    urls = BAD[message]()
    with openai_client(server) as client:
        with pytest.raises(openai.BadRequestError, match=message) as error:
            client.chat.completions.create(model=MODEL, messages=image_message(*urls), max_tokens=4)
        assert error.value.body["param"] == "messages"
        ok = client.chat.completions.create(
            model=MODEL, messages=image_message(data_url(noise_image(3))), max_tokens=2
        )
        assert ok.choices[0].finish_reason == "length"
    wait_idle(server)


def test_an_image_for_a_text_only_model_is_a_400(tiny):
    for base_url, _, _ in in_process_app(tiny("llama")[0]):
        with openai_client(base_url) as client:
            with pytest.raises(openai.BadRequestError, match="text-only") as error:
                client.chat.completions.create(
                    model=MODEL, messages=image_message(data_url(noise_image(1))), max_tokens=2
                )
            assert error.value.body["param"] == "messages"


def test_tokenize_refuses_image_parts(server):
    body = {"model": MODEL, "messages": image_message(data_url(noise_image(1)))}
    response = httpx.post(f"{server}/tokenize", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
