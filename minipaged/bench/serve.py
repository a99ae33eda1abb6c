"""``minipaged bench serve``: online serving latency and throughput against a running
OpenAI-compatible server (paper §6, the online setting; our own take on vLLM's
``benchmarks/benchmark_serving.py``).

Requests are synthetic ShareGPT- or Alpaca-like (`workloads`), cut to fit the served
model's ``max_model_len`` (the vLLM extension field of ``GET /v1/models``): a prompt of
random token ids below 256, which every tokenizer has (the tiny checkpoints' byte-level
vocabulary is exactly these), and ``ignore_eos`` so that each request generates exactly
the tokens it asked for, as vLLM's random-dataset benchmark does.  They arrive as a
Poisson process at ``request_rate`` per second (the paper's §6.1 traces), or all at once
for ``inf``, optionally at most ``max_concurrency`` in flight.

Each request streams ``POST /v1/completions`` and records when every server-sent event
arrived.  The metrics are vLLM's (``calculate_metrics``), over completed requests:

- TTFT: send to the first chunk (queueing and prefill);
- TPOT: (end-to-end latency - TTFT) / (output tokens - 1), for requests with more than
  one output token: the decode pace one user sees;
- ITL: the gaps between successive chunks, every request's pooled;
- E2EL: send to the end of the stream.

A chunk with a choice counts as a token step even when its text is empty: a byte-level
detokenizer holds back the bytes of an unfinished UTF-8 character, yet the token came.
Output token counts come from the final usage chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

from minipaged.bench.args import add_output_flags, results_path
from minipaged.bench.results import write_results
from minipaged.core.memory.workloads import WORKLOADS, arrival_times, synthetic_requests

NAME = "serve"
HELP = "online serving: latency and throughput against a running server"
DESCRIPTION = (
    "Send synthetic requests to an OpenAI-compatible server (minipaged serve, "
    "or any other) as a Poisson process; report TTFT, TPOT, ITL and "
    "end-to-end latency (mean, median, p99) and throughput, as vLLM's "
    "benchmark_serving does."
)
PROMPT_VOCAB = 256  # prompt ids are drawn from [0, PROMPT_VOCAB): bytes in any tokenizer
DEFAULT_MAX_MODEL_LEN = 2048  # when the server does not say (the paper's OPT context)
# Between two chunks of one stream; a request queued behind a long batch hears nothing
# until it is scheduled, so this is generous, but a hung server still ends the run.
READ_TIMEOUT_S = 600.0
METRICS = ("ttft", "tpot", "itl", "e2el")
SHOWN_ERRORS = 3  # the table shows the commonest; the JSON has them all
_TITLES = (
    "Time to First Token",
    "Time per Output Token (excl. 1st token)",
    "Inter-token Latency",
    "End-to-end Latency",
)


class ServerError(ConnectionError):
    """The server cannot be reached, or answered ``/v1/models`` or a test request with an
    error.  A ``ConnectionError`` (an ``OSError``), so the command line prints it plainly."""


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int  # max_tokens; with ignore_eos, exactly the tokens generated


@dataclass
class RequestRecord:
    """What the client saw of one request: ``time.perf_counter()`` seconds at the send,
    at each chunk that carried a choice, and at the end of the stream."""

    prompt_len: int
    output_len: int  # asked for
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0  # from the usage chunk
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    @property
    def tpot(self) -> float | None:
        """None for a single output token: there is no decode time to divide."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


# -- the workload ---------------------------------------------------------------------
def make_requests(
    workload: str,
    num_requests: int,
    max_model_len: int,
    seed: int = 0,
    max_output_len: int | None = None,
) -> list[Request]:
    """``num_requests`` seeded requests whose prompt plus output fit ``max_model_len``;
    ``max_output_len`` caps each output (vLLM's ``--sharegpt-output-len`` fixes it), for
    a short run that keeps the workload's prompts."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    if max_output_len is not None and max_output_len < 1:
        raise ValueError(f"max_output_len must be >= 1 or None, got {max_output_len!r}")
    specs = synthetic_requests(workload, num_requests, seed=seed, max_len=max_model_len)
    cap = max_output_len or max(s.output_len for s in specs)
    # A seed stream of its own, so the ids are not a function of the lengths' draws.
    rng = random.Random(f"prompts-{seed}")
    return [
        Request([rng.randrange(PROMPT_VOCAB) for _ in range(s.prompt_len)], min(s.output_len, cap))
        for s in specs
    ]


# -- the metrics ----------------------------------------------------------------------
def _stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    """Mean, median and p99 (numpy's linear interpolation, as vLLM) in milliseconds;
    None, not vLLM's 0, when nothing was measured: no TPOT is not a TPOT of 0 ms."""
    ms = np.asarray(seconds) * 1e3
    stats = {"mean": np.mean, "median": np.median, "p99": lambda x: np.percentile(x, 99)}
    return {f"{stat}_{name}_ms": float(f(ms)) if len(ms) else None for stat, f in stats.items()}


def _samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Each metric's samples in seconds, over the completed requests."""
    done = [r for r in records if r.success]
    return {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    """vLLM's serving metrics over the completed ``records`` of a run that took
    ``duration_s`` (first send to last end); failures count only in ``failed`` and
    ``errors`` (each distinct message and how many requests it ended, commonest first)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    done = [r for r in records if r.success]
    prompt = sum(r.prompt_len for r in done)
    output = sum(r.output_tokens for r in done)
    summary = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
    }
    for name, seconds in _samples(records).items():
        summary.update(_stats(name, seconds))
    summary["errors"] = dict(Counter(r.error for r in records if not r.success).most_common())
    return summary


# -- the client -----------------------------------------------------------------------
def _api_root(base_url: str) -> str:
    """``http://host:port``; a trailing ``/`` or ``/v1`` (OpenAI clients' habit) is dropped."""
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
    return base_url.rstrip("/").removesuffix("/v1")


def _error_message(response: httpx.Response) -> str:
    try:
        return f"HTTP {response.status_code}: {response.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):  # not the OpenAI error shape
        return f"HTTP {response.status_code}: {response.text[:200]}"


async def fetch_model(client: httpx.AsyncClient, model: str | None = None) -> dict:
    """The served model's card from ``GET /v1/models``: ``model``'s, or the first."""
    url = client.base_url.join("/v1/models")
    try:
        response = await client.get(url)
    except httpx.HTTPError as error:
        raise ServerError(f"cannot reach the server: GET {url}: {error!r}") from None
    if response.status_code != 200:
        raise ServerError(f"GET {url}: {_error_message(response)}")
    try:
        cards = response.json()["data"]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"GET {url}: not an OpenAI model list: {response.text[:200]}") from None
    served = [c.get("id") for c in cards]
    if not served:
        raise ServerError(f"GET {url}: the server serves no model")
    if model is not None and model not in served:
        raise ValueError(f"model must be one the server serves ({served}), got {model!r}")
    return cards[served.index(model) if model is not None else 0]


async def send_request(client: httpx.AsyncClient, model: str, request: Request) -> RequestRecord:
    """Stream one completion, timing every chunk; a failure is recorded, not raised."""
    record = RequestRecord(len(request.prompt_token_ids), request.output_len)
    payload = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    record.start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = _error_message(response)
            else:
                await _read_stream(response, record)
    except httpx.HTTPError as error:
        record.error = f"{type(error).__name__}: {error}"
    record.end = time.perf_counter()
    if record.success and not record.chunk_times:
        record.error = "the stream carried no tokens"
    return record


async def _read_stream(response: httpx.Response, record: RequestRecord) -> None:
    async for line in response.aiter_lines():
        now = time.perf_counter()  # before parsing: the chunk's arrival
        if not line.startswith("data:"):
            continue  # the blank lines between events, or SSE comments
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
            if "error" in chunk:  # a server that fails mid-stream says so in an event
                record.error = f"in stream: {chunk['error']['message']}"
                return
            if chunk.get("choices"):
                record.chunk_times.append(now)
            elif chunk.get("usage"):
                record.output_tokens = chunk["usage"]["completion_tokens"]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            record.error = f"malformed event {data[:100]!r}: {error!r}"
            return
    if record.output_tokens == 0:
        record.error = "no usage chunk (stream_options.include_usage) in the stream"


async def benchmark(
    base_url: str,
    request_rate: float = math.inf,
    num_requests: int = 100,
    workload: str = "sharegpt",
    model: str | None = None,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
    max_output_len: int | None = None,
) -> tuple[dict, list[RequestRecord]]:
    """Run the benchmark against the server at ``base_url``; returns the summary
    (`summarize` plus the setting) and every request's record, in request order."""
    root = _api_root(base_url)
    times = arrival_times(num_requests, request_rate, seed)
    if workload not in WORKLOADS:  # now, not after the server was asked
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency!r}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # httpx pools 100 connections by default: more requests in flight would wait for a
    # connection inside the client, silently capping the concurrency being measured.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=root,
        headers=headers,
        limits=limits,
        timeout=httpx.Timeout(READ_TIMEOUT_S, connect=10.0),
    ) as client:
        card = await fetch_model(client, model)
        max_model_len = card.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
        requests = make_requests(workload, num_requests, max_model_len, seed, max_output_len)
        # One untimed token, so a wrong setup fails once and clearly, and the server has
        # compiled its kernels before the clock starts.  The first prompt reversed: as
        # long, but no prefix for a prefix cache to hand the timed request.
        test = await send_request(
            client, card["id"], Request(requests[0].prompt_token_ids[::-1], 1)
        )
        if not test.success:
            raise ServerError(f"the test request to {root}/v1/completions failed: {test.error}")
        records, duration = await _send_all(
            client, card["id"], requests, times, max_concurrency, progress
        )
    # JSON has no infinity: "inf", as vLLM writes it.
    setting = {
        "model": card["id"],
        "max_model_len": max_model_len,
        "workload": workload,
        "request_rate": float(request_rate) if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "seed": seed,
    }
    return {**setting, **summarize(records, duration)}, records


async def _send_all(
    client, model, requests, times, max_concurrency, progress
) -> tuple[list[RequestRecord], float]:
    slots = asyncio.Semaphore(max_concurrency or len(requests))
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)

    async def one(request: Request) -> RequestRecord:
        async with slots:  # waiting for a slot is not the server's latency: not timed
            record = await send_request(client, model, request)
        bar.update()
        return record

    start = time.perf_counter()
    tasks = []
    for at, request in zip(times, requests):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(request)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


def run(base_url: str, **kwargs) -> tuple[dict, list[RequestRecord]]:
    """`benchmark` from synchronous code: the command line, or a notebook cell (whose
    event loop already runs, so the benchmark gets a thread and a loop of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(benchmark(base_url, **kwargs))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, benchmark(base_url, **kwargs)).result()


# -- output ---------------------------------------------------------------------------
def format_summary(summary: dict) -> str:
    """The table vLLM's benchmark prints."""

    def line(label: str, value) -> str:
        text = "-" if value is None else f"{value:.2f}" if isinstance(value, float) else value
        return f"{label:<40}{text:>10}"

    lines = [
        f"{' Serving Benchmark Result ':=^50}",
        line("Request rate (req/s):", summary["request_rate"]),
        line("Successful requests:", summary["completed"]),
        line("Failed requests:", summary["failed"]),
        line("Benchmark duration (s):", summary["duration_s"]),
        line("Total input tokens:", summary["total_input_tokens"]),
        line("Total generated tokens:", summary["total_output_tokens"]),
        line("Request throughput (req/s):", summary["request_throughput"]),
        line("Output token throughput (tok/s):", summary["output_throughput"]),
        line("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for name, title in zip(METRICS, _TITLES):
        lines.append(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            lines.append(
                line(f"{stat.capitalize()} {name.upper()} (ms):", summary[f"{stat}_{name}_ms"])
            )
    errors = list(summary["errors"].items())
    lines += [f"error ({count}x): {message}" for message, count in errors[:SHOWN_ERRORS]]
    if len(errors) > SHOWN_ERRORS:
        lines.append(f"... and {len(errors) - SHOWN_ERRORS} more distinct errors in the JSON")
    return "\n".join([*lines, "=" * 50])


def print_summary(summary: dict) -> None:
    print(format_summary(summary))


def plot_latencies(records: list[RequestRecord], title: str = ""):
    """The distributions behind the summary: the CDF of TTFT, TPOT, ITL and E2EL over
    the completed requests, median and p99 marked.  A matplotlib ``Figure``, no pyplot."""
    from matplotlib.figure import Figure

    samples = _samples(records)
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    for ax, name, label in zip(fig.subplots(2, 2).flat, METRICS, _TITLES):
        ms = np.sort(np.asarray(samples[name]) * 1e3)
        ax.set_title(label, fontsize="medium")
        ax.set_xlabel("ms")
        if len(ms) == 0:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post")
        for q, style in ((50, "--"), (99, ":")):
            ax.axvline(
                np.percentile(ms, q),
                color="gray",
                linestyle=style,
                linewidth=1,
                label=f"p{q} {np.percentile(ms, q):.1f} ms",
            )
        ax.set_ylabel("fraction of samples")
        ax.legend(fontsize="small", loc="lower right")
    fig.suptitle(title or f"serving latency, {len(samples['e2el'])} completed requests")
    return fig


def save_results(
    path: str | Path, summary: dict, records: list[RequestRecord], command: str, device: str = "cpu"
) -> Path:
    """The JSON (one row: the summary; each request's lengths and times beside it) and
    the latency PNG.  ``device`` is the server's, which the client cannot see: the
    caller names it (right as it stands when both run on one machine)."""
    requests = [
        {
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "output_tokens": r.output_tokens,
            "error": r.error,
            "ttft_ms": r.ttft * 1e3 if r.chunk_times else None,
            "e2el_ms": r.latency * 1e3,
        }
        for r in records
    ]
    rate = summary["request_rate"]
    title = (
        f"{summary['model']}: {summary['workload']}-like requests at {rate} req/s, "
        f"{summary['completed']} completed"
    )
    return write_results(
        path, [summary], device, command, figure=plot_latencies(records, title), requests=requests
    )


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        metavar="R",
        help="requests per second, Poisson arrivals (default: inf, all at once)",
    )
    parser.add_argument(
        "--num-requests", type=int, default=100, metavar="N", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="sharegpt",
        help="request lengths like this dataset's (default: %(default)s)",
    )
    parser.add_argument("--model", help="the served model's name (default: the first listed)")
    parser.add_argument(
        "--max-concurrency",
        type=int,
        metavar="N",
        help="at most N requests in flight (default: no limit)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MINIPAGED_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $MINIPAGED_API_KEY)",
    )
    parser.add_argument(
        "--max-output-len",
        type=int,
        metavar="N",
        help="cap every request's output at N tokens (default: the workload's lengths)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds lengths, prompts, arrivals")
    parser.add_argument(
        "--device",
        default=None,
        help="the server's device, which the results record and "
        "--update-committed's directory is named after (default: cuda "
        "if this machine has one, else cpu)",
    )
    add_output_flags(parser, NAME)


def main(args) -> None:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    summary, records = run(
        args.base_url,
        request_rate=args.request_rate,
        num_requests=args.num_requests,
        workload=args.workload,
        model=args.model,
        max_concurrency=args.max_concurrency,
        api_key=args.api_key,
        seed=args.seed,
        max_output_len=args.max_output_len,
    )
    print_summary(summary)
    path = save_results(
        results_path(args, NAME, device), summary, records, args.command_line, device=device
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")
