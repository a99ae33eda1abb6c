"""LangChain's OpenAI clients (``langchain-openai``) against ``minipaged serve``, as an
application calls it: ``ChatOpenAI`` and ``OpenAI`` for invoke, batch and stream.

The oracle is the offline ``LLM`` on the same checkpoint (``LLM.chat``,
``LLM.generate``; itself checked against Hugging Face in test_engine.py and
test_real_model.py): greedy answers equal.  Through Ray Serve: test_ray_serve.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")  # the server extra
langchain_openai = pytest.importorskip("langchain_openai")

from engine_helpers import make_llm  # noqa: E402
from minipaged import SamplingParams  # noqa: E402
from server_helpers import ENGINE, MODEL, in_process  # noqa: E402

QUESTIONS = ["What is a cache?", "Name a colour.", "Count to three."]
PROMPTS = ["Once upon a time", "The capital of France is"]
OPTIONS = dict(api_key="unused", model=MODEL, temperature=0, max_tokens=8, max_retries=0)
ORACLE = {k: v for k, v in ENGINE.items() if k != "device"}


def served(path):
    """``minipaged serve`` (the app in this process) and the offline ``LLM``, on ``path``."""
    for url, _ in in_process(path):
        yield url, make_llm(path, **ORACLE)


@pytest.fixture(scope="module")
def tiny_server(tiny):
    path, _ = tiny("llama")
    yield from served(path)


def chat_answers(llm, questions: list[str], max_tokens: int = 8) -> list[str]:
    """``LLM.chat``'s greedy reply to each question, asked alone."""
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].text for o in llm.chat(conversations, params, use_tqdm=False)]


def test_chat_openai_invoke_batch_and_stream(tiny_server):
    url, llm = tiny_server
    chat = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", **OPTIONS)
    want = chat_answers(llm, QUESTIONS)
    assert chat.invoke(QUESTIONS[0]).content == want[0]
    assert [m.content for m in chat.batch(QUESTIONS)] == want
    chunks = list(chat.stream(QUESTIONS[1]))
    assert len(chunks) > 1 and "".join(c.content for c in chunks) == want[1]


def test_openai_completions_invoke_batch_and_stream(tiny_server):
    url, llm = tiny_server
    completions = langchain_openai.OpenAI(base_url=f"{url}/v1", **OPTIONS)
    want = [
        o.outputs[0].text
        for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    ]
    assert completions.invoke(PROMPTS[0]) == want[0]
    assert completions.batch(PROMPTS) == want
    chunks = list(completions.stream(PROMPTS[1]))
    assert len(chunks) > 1 and "".join(chunks) == want[1]


def test_chat_openai_on_smollm2_answers_as_llm_chat(smollm2):
    for url, llm in served(smollm2):
        chat = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", **{**OPTIONS, "max_tokens": 24})
        question = "What is the capital of France?"
        (want,) = chat_answers(llm, [question], max_tokens=24)
        answer = chat.invoke(question).content
        assert answer == want and "Paris" in answer
