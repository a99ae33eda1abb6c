"""LoRA adapters over HTTP, as vLLM serves them: the ``model`` field routes a request to
an adapter, ``/v1/models`` lists each adapter with the base model as its parent, and
adapters are loaded and unloaded by name.  The oracle is PEFT on the same files."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from lora_helpers import PeftOracle, make_adapter
from server_helpers import MODEL, in_process_app, wait_idle

PROMPT = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    base, _ = tiny("llama")
    root = tmp_path_factory.mktemp("served-adapters")
    paths = {
        "sql": make_adapter(base, root / "sql", seed=11, r=8),
        "poet": make_adapter(base, root / "poet", seed=12, r=4, targets=["q_proj", "up_proj"]),
    }
    return base, paths


@pytest.fixture(scope="module")
def base_url(adapters):
    base, paths = adapters
    yield from (
        url
        for url, _, _ in in_process_app(
            base,
            engine_kwargs=dict(enable_lora=True, max_loras=2),
            lora_modules=[f"sql={paths['sql']}"],
        )
    )


def complete(base_url: str, model: str) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=60,
    )


def expected_text(base, adapter=None) -> str:
    oracle = PeftOracle(base, adapter)
    tokens = oracle.greedy(tuple(PROMPT), MAX_TOKENS)
    return AutoTokenizer.from_pretrained(base).decode(tokens, skip_special_tokens=True)


def assert_openai_error(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and words in error["message"]


def test_models_lists_each_adapter_with_the_base_as_parent(base_url, adapters):
    _, paths = adapters
    cards = {card["id"]: card for card in httpx.get(f"{base_url}/v1/models").json()["data"]}
    assert set(cards) == {MODEL, "sql"}
    assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == str(paths["sql"])


def test_the_model_field_routes_to_the_adapter(base_url, adapters):
    base, paths = adapters
    response = complete(base_url, "sql")
    assert response.json()["model"] == "sql"
    assert response.json()["choices"][0]["text"] == expected_text(base, paths["sql"])
    plain = complete(base_url, MODEL).json()["choices"][0]["text"]
    assert plain == expected_text(base)
    assert_openai_error(complete(base_url, "nope"), 404, "The model `nope` does not exist.")
    wait_idle(base_url)


def test_load_and_unload_adapters_by_name(base_url, adapters, tmp_path):
    base, paths = adapters
    load = f"{base_url}/v1/load_lora_adapter"
    unload = f"{base_url}/v1/unload_lora_adapter"
    (tmp_path / "adapter_config.json").write_text('{"r": 4')  # torn
    assert_openai_error(
        httpx.post(load, json={"lora_name": "bad", "lora_path": str(tmp_path)}),
        400,
        f"{tmp_path}/adapter_config.json",
    )
    response = httpx.post(load, json={"lora_name": "poet", "lora_path": str(paths["poet"])})
    assert response.status_code == 200, response.text
    assert_openai_error(
        httpx.post(load, json={"lora_name": "poet", "lora_path": str(paths["poet"])}),
        400,
        "already been loaded",
    )
    text = complete(base_url, "poet").json()["choices"][0]["text"]
    assert text == expected_text(base, paths["poet"])
    assert httpx.post(unload, json={"lora_name": "poet"}).status_code == 200
    assert_openai_error(complete(base_url, "poet"), 404, "does not exist")
    assert_openai_error(httpx.post(unload, json={"lora_name": "poet"}), 404, "cannot be found")
    ids = [card["id"] for card in httpx.get(f"{base_url}/v1/models").json()["data"]]
    assert ids == [MODEL, "sql"]
    wait_idle(base_url)
