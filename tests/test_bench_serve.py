"""``minipaged bench serve``'s library: vLLM's metrics on hand-computed records, requests
that fit the model, the streaming protocol (on an in-memory transport, no server) and
clear errors.  The Poisson arrivals are tested in test_workloads.py, the run against a
real ``minipaged serve`` in the server's tests."""

import asyncio
import json
import math
import socket

import httpx
import pytest

from minipaged.bench import serve
from minipaged.bench.serve import Request, RequestRecord, ServerError
from minipaged.core.memory.workloads import synthetic_requests


def hand_made_records() -> list[RequestRecord]:
    """Times in seconds; each request's metrics worked out in the comment beside it."""
    return [
        # TTFT 0.1, ITL 0.2 0.3, E2EL 0.7, TPOT (0.7 - 0.1) / 2 = 0.3
        RequestRecord(10, 3, start=0.0, chunk_times=[0.1, 0.3, 0.6], end=0.7, output_tokens=3),
        # TTFT 0.2, ITL 0.1, E2EL 0.4, TPOT (0.4 - 0.2) / 1 = 0.2
        RequestRecord(20, 2, start=1.0, chunk_times=[1.2, 1.3], end=1.4, output_tokens=2),
        # one token: TTFT 0.4, E2EL 0.5, no ITL, no TPOT
        RequestRecord(5, 1, start=2.0, chunk_times=[2.4], end=2.5, output_tokens=1),
        RequestRecord(7, 4, start=3.0, end=3.1, error="HTTP 400: too long"),
    ]


def test_summarize_matches_hand_computed_metrics():
    s = serve.summarize(hand_made_records(), duration_s=4.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["errors"] == {"HTTP 400: too long": 1}
    # the failed request's 7 prompt tokens do not count
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 6)
    assert s["request_throughput"] == pytest.approx(3 / 4)
    assert s["output_throughput"] == pytest.approx(6 / 4)
    assert s["total_token_throughput"] == pytest.approx(41 / 4)
    # p99 interpolates linearly (numpy's default, as vLLM): of 3 sorted samples a, b, c
    # it is b + 0.98 (c - b); of 2, a + 0.99 (b - a).
    expected = {
        "ttft": (700 / 3, 200, 396),
        "tpot": (250, 250, 299),
        "itl": (200, 200, 298),
        "e2el": (1600 / 3, 500, 696),
    }
    for name, (mean, median, p99) in expected.items():
        got = [s[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p99")]
        assert got == pytest.approx([mean, median, p99]), name


def test_summarize_with_nothing_measured_says_none_not_zero():
    s = serve.summarize(
        [
            RequestRecord(5, 1, chunk_times=[0.5], end=1.0, output_tokens=1),
            RequestRecord(5, 3, error="ReadTimeout: timed out"),
        ],
        duration_s=2.0,
    )
    assert s["completed"] == 1 and s["failed"] == 1
    assert s["mean_tpot_ms"] is s["p99_itl_ms"] is None
    assert s["median_ttft_ms"] == pytest.approx(500)
    s = serve.summarize([RequestRecord(5, 3, error="refused")], duration_s=1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["request_throughput"] == 0


@pytest.mark.parametrize("duration", [0, -1.0, math.nan])
def test_summarize_rejects_a_bad_duration(duration):
    with pytest.raises(ValueError, match="duration_s"):
        serve.summarize(hand_made_records(), duration)


# -- requests -------------------------------------------------------------------------
@pytest.mark.parametrize("workload", ["sharegpt", "alpaca"])
@pytest.mark.parametrize("max_model_len", [64, 1024])
def test_requests_fit_the_model_with_exact_prompt_lengths(workload, max_model_len):
    requests = serve.make_requests(workload, 200, max_model_len, seed=1)
    specs = synthetic_requests(workload, 200, seed=1, max_len=max_model_len)
    assert [len(r.prompt_token_ids) for r in requests] == [s.prompt_len for s in specs]
    assert [r.output_len for r in requests] == [s.output_len for s in specs]
    assert all(len(r.prompt_token_ids) + r.output_len <= max_model_len for r in requests)
    assert all(0 <= i < serve.PROMPT_VOCAB for r in requests for i in r.prompt_token_ids)
    assert requests == serve.make_requests(workload, 200, max_model_len, seed=1)


def test_max_output_len_caps_outputs_and_keeps_prompts():
    specs = synthetic_requests("alpaca", 50, seed=1, max_len=1024)
    capped = serve.make_requests("alpaca", 50, 1024, seed=1, max_output_len=16)
    assert [r.output_len for r in capped] == [min(s.output_len, 16) for s in specs]
    assert any(s.output_len > 16 for s in specs)  # else the cap was not exercised
    assert [r.prompt_token_ids for r in capped] == [
        r.prompt_token_ids for r in serve.make_requests("alpaca", 50, 1024, seed=1)
    ]


def test_short_model_cuts_sharegpt_requests():
    # ShareGPT's tail is longer than 64 tokens: without the cut this test means nothing.
    assert max(s.total_len for s in synthetic_requests("sharegpt", 200, seed=1)) > 64


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_requests": 0}, "num_requests"),
        ({"workload": "lmsys"}, "workload"),
        ({"max_output_len": 0}, "max_output_len"),
    ],
)
def test_make_requests_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        serve.make_requests(
            **{"workload": "sharegpt", "num_requests": 4, "max_model_len": 128, **kwargs}
        )


# -- the protocol, on an in-memory transport ------------------------------------------
def sse(*events) -> bytes:
    return b"".join(
        f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events
    )


def choice(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny", "object": "model", "max_model_len": 1024},
        {"id": "other", "object": "model"},
    ],
}


def send(body: bytes, status: int = 200):
    """``send_request`` against a server whose every answer is ``body``; also returns
    what the client sent."""
    seen = []

    def handler(http_request: httpx.Request) -> httpx.Response:
        seen.append(http_request)
        return httpx.Response(status, content=body)

    async def go():
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(handler), base_url="http://server"
        ) as client:
            return await serve.send_request(client, "tiny", Request([1, 2, 3], 3))

    return asyncio.run(go()), seen


def test_a_stream_is_timed_chunk_by_chunk():
    # The empty text is a token whose byte did not finish a UTF-8 character: it counts.
    record, seen = send(sse(choice("a"), choice(""), choice("b", "length"), USAGE, "[DONE]"))
    assert record.success and record.output_tokens == 3 and len(record.chunk_times) == 3
    assert record.start <= record.chunk_times[0] <= record.chunk_times[-1] <= record.end
    sent = json.loads(seen[0].content)
    assert seen[0].url.path == "/v1/completions"
    assert sent == {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "max_tokens": 3,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@pytest.mark.parametrize(
    "body, status, error",
    [
        (
            json.dumps(
                {
                    "error": {
                        "message": "prompt too long",
                        "type": "BadRequestError",
                        "param": "prompt",
                        "code": 400,
                    }
                }
            ).encode(),
            400,
            "HTTP 400: prompt too long",
        ),
        (b"Internal Server Error", 500, "HTTP 500: Internal Server Error"),
        (sse(choice("a"), {"error": {"message": "engine died"}}), 200, "in stream: engine died"),
        (sse(choice("a"), choice("b"), "[DONE]"), 200, "no usage chunk"),
        (sse(USAGE, "[DONE]"), 200, "no tokens"),
        (sse("{not json"), 200, "malformed event"),
    ],
)
def test_a_failed_request_is_recorded_not_raised(body, status, error):
    record, _ = send(body, status)
    assert not record.success and error in record.error


def fetch(body, status: int = 200, model: str | None = None) -> dict:
    async def go():
        transport = httpx.MockTransport(lambda _: httpx.Response(status, json=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await serve.fetch_model(client, model)

    return asyncio.run(go())


def test_fetch_model_picks_the_named_model_or_the_first():
    assert fetch(MODELS)["max_model_len"] == 1024
    assert fetch(MODELS, model="other")["id"] == "other"
    with pytest.raises(ValueError, match="model must be one the server serves.*'nope'"):
        fetch(MODELS, model="nope")


@pytest.mark.parametrize(
    "body, status, error",
    [
        ({"error": {"message": "invalid API key"}}, 401, "HTTP 401: invalid API key"),
        ({"object": "list", "data": []}, 200, "serves no model"),
        ({"models": []}, 200, "not an OpenAI model list"),
    ],
)
def test_fetch_model_errors_name_the_cause(body, status, error):
    with pytest.raises(ServerError, match=error):
        fetch(body, status)


# -- benchmark(): arguments and an absent server --------------------------------------
@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"base_url": "localhost:8000"}, "base_url"),
        ({"request_rate": 0}, "request_rate"),
        ({"request_rate": -2.0}, "request_rate"),
        ({"num_requests": 0}, "num_requests"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"workload": "lmsys"}, "workload"),
    ],
)
def test_bad_arguments_fail_before_any_request(kwargs, name):
    # port 9 (discard) is never asked: validation comes first
    with pytest.raises(ValueError, match=name):
        serve.run(**{"base_url": "http://127.0.0.1:9", "progress": False, **kwargs})


def test_an_unreachable_server_is_a_clear_oserror():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerError, match=f"cannot reach the server.*127.0.0.1:{port}"):
        serve.run(f"http://127.0.0.1:{port}/v1", num_requests=2, progress=False)
    assert issubclass(ServerError, OSError)  # what the command line prints plainly


# -- output ---------------------------------------------------------------------------
def test_table_and_results_file(tmp_path):
    records = hand_made_records()
    summary = {
        "model": "tiny",
        "max_model_len": 1024,
        "workload": "alpaca",
        "request_rate": "inf",
        "max_concurrency": None,
        "seed": 0,
        **serve.summarize(records, 4.0),
    }
    table = serve.format_summary(summary)
    assert "Successful requests:" in table and "Median TPOT (ms):" in table
    assert "error (1x): HTTP 400: too long" in table
    path = serve.save_results(tmp_path / "serve.json", summary, records, "minipaged bench serve")
    doc = json.loads(path.read_text())
    assert {"device", "torch", "triton", "date", "command", "results", "requests"} <= doc.keys()
    assert doc["results"] == [summary]
    assert [r["ttft_ms"] for r in doc["requests"]] == pytest.approx([100, 200, 400, None])
    assert path.with_suffix(".png").stat().st_size > 0


def test_plot_survives_no_completed_request():
    fig = serve.plot_latencies([RequestRecord(3, 3, error="refused")])
    assert len(fig.axes) == 4


def test_table_shows_the_commonest_errors_only():
    records = [RequestRecord(1, 1, error=f"error {i}") for i in range(5)]
    records += [RequestRecord(1, 1, error="error 4")]
    s = serve.summarize(records, 1.0)
    assert list(s["errors"]) == ["error 4", "error 0", "error 1", "error 2", "error 3"]
    s.update(request_rate=1.0)
    table = serve.format_summary(s)
    assert "error (2x): error 4" in table and "error 3" not in table
    assert "2 more distinct errors" in table
