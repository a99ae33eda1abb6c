"""``minipaged serve MODEL --runner pooling``: OpenAI's ``/v1/embeddings`` through the
official ``openai`` client (floats and base64) and LangChain's ``OpenAIEmbeddings``.

The oracle is Hugging Face's base model on the same tiny checkpoint: the last token's
final hidden state, normalized by hand (the engine's default pooler, LAST).  A pooling
server refuses completions and chat, a generating one refuses embeddings, and bad
inputs get OpenAI's 400s while the server goes on.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fastapi")  # the server extra
openai = pytest.importorskip("openai")

from transformers import AutoModel, AutoTokenizer  # noqa: E402

from server_helpers import MODEL, in_process, in_process_app, wait_idle  # noqa: E402

TEXTS = ["The capital of France is", "Paged attention", "a"]
FP32 = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama")[0]


@pytest.fixture(scope="module")
def server(llama):
    for base_url, _, _ in in_process_app(llama, engine_kwargs={"runner": "pooling"}):
        yield base_url


@pytest.fixture(scope="module")
def oracle(llama):
    model = AutoModel.from_pretrained(llama, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(llama, local_files_only=True)

    def embed(prompt) -> torch.Tensor:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        with torch.no_grad():
            return F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)

    embed.tokenizer = tokenizer
    return embed


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_embeddings_create_as_floats_match_hf(client, oracle):
    response = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2]
    for text, data in zip(TEXTS, response.data):
        torch.testing.assert_close(torch.tensor(data.embedding), oracle(text), **FP32)
    assert response.usage.prompt_tokens == sum(len(oracle.tokenizer.encode(t)) for t in TEXTS)
    assert response.usage.total_tokens == response.usage.prompt_tokens


def test_base64_is_little_endian_float32(server, oracle):
    body = {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}
    response = httpx.post(f"{server}/v1/embeddings", json=body)
    assert response.status_code == 200, response.text
    raw = base64.b64decode(response.json()["data"][0]["embedding"])
    vector = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())
    torch.testing.assert_close(vector, oracle(TEXTS[0]), **FP32)


def test_the_openai_client_decodes_its_default_base64(client, oracle):
    """The client asks for base64 when no format is given, and decodes it itself."""
    (data,) = client.embeddings.create(model=MODEL, input="Paged attention").data
    torch.testing.assert_close(torch.tensor(data.embedding), oracle("Paged attention"), **FP32)


def test_token_arrays_and_lists_of_them(client, oracle):
    arrays = [[5, 6, 7, 8], [9, 10]]
    one = client.embeddings.create(model=MODEL, input=arrays[0], encoding_format="float")
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), oracle(arrays[0]), **FP32)
    both = client.embeddings.create(model=MODEL, input=arrays, encoding_format="float")
    for array, data in zip(arrays, both.data):
        torch.testing.assert_close(torch.tensor(data.embedding), oracle(array), **FP32)
    assert both.usage.prompt_tokens == 6


def test_langchain_openai_embeddings(server, oracle):
    langchain_openai = pytest.importorskip("langchain_openai")
    embeddings = langchain_openai.OpenAIEmbeddings(
        base_url=f"{server}/v1",
        api_key="unused",
        model=MODEL,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    vectors = embeddings.embed_documents(TEXTS[:2])
    for text, vector in zip(TEXTS[:2], vectors):
        torch.testing.assert_close(torch.tensor(vector), oracle(text), **FP32)
    query = embeddings.embed_query(TEXTS[2])
    torch.testing.assert_close(torch.tensor(query), oracle(TEXTS[2]), **FP32)


BAD = {
    "empty input": ({"input": ""}, "input"),
    "empty list": ({"input": []}, "input"),
    "token out of vocab": ({"input": [1, 10**6]}, None),
    "dimensions without matryoshka": ({"input": "a", "dimensions": 8}, None),
    "dimensions zero": ({"input": "a", "dimensions": 0}, "dimensions"),
    "encoding format": ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    "unsupported field": ({"input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    "too long": ({"input": list(range(200))}, "input"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_inputs_are_openai_400s_and_the_server_goes_on(server, client, oracle, name):
    body, param = BAD[name]
    response = httpx.post(f"{server}/v1/embeddings", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    (data,) = client.embeddings.create(model=MODEL, input="a", encoding_format="float").data
    torch.testing.assert_close(torch.tensor(data.embedding), oracle("a"), **FP32)
    wait_idle(server)  # nothing left running, every block free


@pytest.mark.parametrize(
    "path, body",
    [
        ("completions", {"prompt": "a", "max_tokens": 2}),
        ("chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
    ],
)
def test_a_pooling_server_refuses_generation(server, path, body):
    response = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, **body})
    assert response.status_code == 400
    assert "--runner pooling" in response.json()["error"]["message"]


def test_a_generating_server_refuses_embeddings(llama):
    for base_url, _ in in_process(llama):
        response = httpx.post(f"{base_url}/v1/embeddings", json={"model": MODEL, "input": "a"})
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "does not support the Embeddings API" in message and "--runner pooling" in message
