"""``minipaged bench chaos``: load and faults at once against an OpenAI-compatible server.

Many clients send a seeded mix of requests, each of one kind:

- good ones, which must be answered in full (200, every choice finished, a stream
  ending in ``[DONE]`` without an error event): completions, streamed completions, chat;
- invalid ones, which must be refused with a 4xx and nothing else: malformed JSON, a body
  over the size cap, bad sampling values, a lone surrogate, an unknown model;
- clients that leave: a stream dropped after a few chunks, an answer not waited for,
  half a body sent and the connection closed.

Afterwards the server must go idle with every KV block free (``/metrics``) and still
answer ``/health``.  The report counts the requests served, the statuses by kind, what
was unexpected (any 5xx, a transport error, a good request refused or an invalid one
accepted), the blocks leaked, and the p50/p99 latency of the good requests.

Without ``--base-url`` it starts ``minipaged serve`` itself on the tiny demo checkpoint
(`minipaged.models.tiny.cached_checkpoint`), with a small body cap, and stops it after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

NAME = "chaos"
HELP = "load and faults: many clients, dropped connections, invalid requests"
DESCRIPTION = (
    "Send a seeded mix of good requests, invalid ones and clients that hang "
    "up to a server (by default one started here on the tiny demo "
    "checkpoint); report requests served, statuses by kind, anything "
    "unexpected (a 5xx, a good request refused), KV blocks leaked and the "
    "good requests' p50/p99 latency.  Exits 1 if the server broke a rule."
)
# kind: (weight, what it is); good kinds first.
KINDS = {
    "completion": (4, "a greedy completion, waited for"),
    "stream": (3, "a streamed completion, read to [DONE]"),
    "chat": (2, "a chat completion"),
    "extreme_sampling": (1, "valid but extreme sampling values, answered like any other"),
    "malformed_json": (1, "a body that is not JSON"),
    "huge_body": (1, "a body one byte over the cap"),
    "bad_sampling": (2, "a sampling value out of range"),
    "lone_surrogate": (1, "a prompt with half a UTF-16 pair"),
    "unknown_model": (1, "a model the server does not serve"),
    "dropped_stream": (2, "a stream dropped after two chunks"),
    "dropped_wait": (1, "an answer not waited for"),
    "half_body": (1, "half a body, then the connection closed"),
}
GOOD = ("completion", "stream", "chat", "extreme_sampling")
LEAVING = ("dropped_stream", "dropped_wait", "half_body")
BAD_SAMPLING = [
    {"top_p": 1.5},
    {"temperature": -1.0},
    {"n": 0},
    {"max_tokens": -1},
    {"top_k": -5},
    {"logprobs": 21},
    {"min_p": 2.0},
]
# In range, yet once enough to kill an engine: a top_p that rounds to 0 in float32.
EXTREME_SAMPLING = [
    {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1e-3, "min_p": 1.0},
    {"temperature": 2.0, "repetition_penalty": 100.0, "presence_penalty": 2.0},
]
IDLE_TIMEOUT_S = 30.0


@dataclass
class Outcome:
    """One request: its kind, the status it got (None: no answer) and how long it took."""

    kind: str
    status: int | None
    seconds: float
    problem: str | None = None  # why it counts as unexpected


@dataclass
class ChaosReport:
    outcomes: list[Outcome]
    duration_s: float
    blocks_leaked: int
    alive: bool
    statuses: dict[str, Counter] = field(init=False)

    def __post_init__(self) -> None:
        self.statuses = {
            kind: Counter(o.status for o in self.outcomes if o.kind == kind) for kind in KINDS
        }

    @property
    def unexpected(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem is not None]

    def latency_ms(self, q: float) -> float | None:
        good = [o.seconds for o in self.outcomes if o.kind in GOOD and o.problem is None]
        return float(np.percentile(good, q) * 1000) if good else None

    def as_dict(self) -> dict:
        return {
            "requests": len(self.outcomes),
            "duration_s": self.duration_s,
            "served": sum(o.kind in GOOD and o.problem is None for o in self.outcomes),
            "statuses": {k: {str(s): n for s, n in c.items()} for k, c in self.statuses.items()},
            "unexpected": [o.__dict__ for o in self.unexpected],
            "blocks_leaked": self.blocks_leaked,
            "alive": self.alive,
            "p50_ms": self.latency_ms(50),
            "p99_ms": self.latency_ms(99),
        }


# -- the requests ----------------------------------------------------------------------
def _body(rng: random.Random, model: str) -> dict:
    prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 24))]
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": rng.randint(2, 24),
        "temperature": 0,
        "ignore_eos": True,
    }


async def _post(client: httpx.AsyncClient, path: str, **kwargs) -> httpx.Response:
    return await client.post(f"/v1/{path}", **kwargs)


async def _good(client, kind: str, body: dict, rng: random.Random) -> tuple[int, str | None]:
    """A good request's status and, if its answer is not whole, what is wrong."""
    if kind == "extreme_sampling":
        body = {**body, **rng.choice(EXTREME_SAMPLING)}
    if kind == "chat":
        body = {
            "model": body["model"],
            "max_tokens": body["max_tokens"],
            "messages": [{"role": "user", "content": "Say something."}],
        }
    if kind != "stream":
        response = await _post(
            client, "chat/completions" if kind == "chat" else "completions", json=body
        )
        if response.status_code != 200:
            return response.status_code, response.text[:200]
        finished = all(c["finish_reason"] for c in response.json()["choices"])
        return 200, None if finished else "a choice did not finish"
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = [line async for line in r.aiter_lines() if line]
    if r.status_code != 200:
        return r.status_code, "refused"
    if lines[-1:] != ["data: [DONE]"] or any('"error"' in line for line in lines):
        return 200, f"the stream ended badly: {lines[-2:]}"
    return 200, None


async def _invalid(client, kind: str, body: dict, rng: random.Random, huge_bytes: int) -> int:
    headers = {"content-type": "application/json"}
    if kind == "malformed_json":
        response = await _post(client, "completions", content=b'{"prompt": [1, 2', headers=headers)
    elif kind == "huge_body":
        response = await _post(client, "completions", content=b" " * huge_bytes, headers=headers)
    elif kind == "bad_sampling":
        response = await _post(client, "completions", json={**body, **rng.choice(BAD_SAMPLING)})
    elif kind == "lone_surrogate":
        text = json.dumps({**body, "prompt": "x"}).replace('"x"', '"a\\ud800b"')
        response = await _post(client, "completions", content=text.encode(), headers=headers)
    else:
        response = await _post(client, "completions", json={**body, "model": "no-such-model"})
    return response.status_code


async def _leave(client, kind: str, body: dict, address: tuple[str, int]) -> None:
    """A client that goes away: mid-stream, before the answer, or mid-body."""
    if kind == "dropped_stream":
        long = {**body, "max_tokens": 64, "stream": True}
        async with client.stream("POST", "/v1/completions", json=long) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += bool(line)
                if chunks == 2:
                    break  # leaving the block closes the connection
    elif kind == "dropped_wait":
        with contextlib.suppress(httpx.TimeoutException):
            await _post(client, "completions", json={**body, "max_tokens": 64}, timeout=0.05)
    else:
        _, writer = await asyncio.open_connection(*address)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: "
            + address[0].encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
            b'{"prompt": "a'
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()


async def one_request(
    client,
    kind: str,
    rng: random.Random,
    model: str,
    huge_bytes: int,
    address: tuple[str, int],
) -> Outcome:
    """Send one request of ``kind``; an outcome that breaks the rules says why."""
    body, start = _body(rng, model), time.perf_counter()
    try:
        if kind in GOOD:
            status, problem = await _good(client, kind, body, rng)
        elif kind in LEAVING:
            await _leave(client, kind, body, address)
            status, problem = None, None
        else:
            status = await _invalid(client, kind, body, rng, huge_bytes)
            problem = None if 400 <= status < 500 else f"{status} for an invalid request"
    except httpx.HTTPError as error:
        status, problem = None, f"{type(error).__name__}: {error}"
    return Outcome(kind, status, time.perf_counter() - start, problem)


# -- the run ---------------------------------------------------------------------------
async def _run_clients(
    base_url: str,
    num_requests: int,
    concurrency: int,
    seed: int,
    huge_bytes: int,
    model: str,
    kinds: list[str],
) -> list[Outcome]:
    rng = random.Random(seed)
    kinds = rng.choices(kinds, weights=[KINDS[k][0] for k in kinds], k=num_requests)
    seeds = [rng.randrange(2**32) for _ in kinds]
    url = urlsplit(base_url)
    address = (url.hostname, url.port or 80)
    limit = asyncio.Semaphore(concurrency)
    # A connection per request: the server closes a keep-alive connection left idle for
    # its head timeout, and a request sent on one just as it closes would fail through
    # the client's reuse, not anything the server did with the request.
    pool = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=pool) as client:

        async def bounded(kind, request_seed):
            async with limit:
                return await one_request(
                    client,
                    kind,
                    random.Random(request_seed),
                    model,
                    huge_bytes,
                    address,
                )

        return await asyncio.gather(*(bounded(k, s) for k, s in zip(kinds, seeds)))


def wait_idle(base_url: str, timeout_s: float = IDLE_TIMEOUT_S) -> int:
    """Blocks still used once no request runs or waits (aborts land between steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("minipaged:")
        }
        busy = sum(
            values.get(f"minipaged:{name}", 0)
            for name in (
                "num_requests_running",
                "num_requests_waiting",
                "num_requests_swapped",
            )
        )
        used = int(values["minipaged:kv_blocks_used"] + values["minipaged:cpu_kv_blocks_used"])
        if (busy == 0 and used == 0) or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


def run(
    base_url: str,
    num_requests: int = 400,
    concurrency: int = 32,
    seed: int = 0,
    huge_bytes: int = 8 * 2**20 + 1,
    kinds: list[str] | None = None,
) -> ChaosReport:
    """The chaos run against ``base_url``; ``huge_bytes`` should be one over its body
    cap; ``kinds`` (default: all of `KINDS`) narrows the mix."""
    for name, value in (("num_requests", num_requests), ("concurrency", concurrency)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    kinds = list(KINDS) if kinds is None else kinds
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"kinds must be a non-empty list of {sorted(KINDS)}, got {kinds!r}")
    model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    start = time.perf_counter()
    outcomes = asyncio.run(
        _run_clients(base_url, num_requests, concurrency, seed, huge_bytes, model, kinds)
    )
    duration = time.perf_counter() - start
    leaked = wait_idle(base_url)
    alive = httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    return ChaosReport(outcomes, duration, leaked, alive)


@contextlib.contextmanager
def local_server(max_body_bytes: int = 2**20):
    """``minipaged serve`` on the tiny demo checkpoint with a small body cap
    (`serve_process`)."""
    from minipaged.models.tiny import cached_checkpoint

    flags = ["--device", "cpu", "--max-model-len", "128", "--swap-space", "0.01"]
    flags += ["--max-request-bytes", str(max_body_bytes), "--read-timeout", "2"]
    with serve_process(cached_checkpoint("tiny-llama"), flags) as base_url:
        yield base_url


@contextlib.contextmanager
def serve_process(model, flags: list[str]):
    """``minipaged serve model *flags`` on a free loopback port; yields its base URL and
    stops it (SIGINT) after.  Its log is kept in a temporary file, named if it fails to
    start."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = Path(tempfile.mkdtemp(prefix="minipaged-serve-")) / "serve.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "minipaged", "serve", str(model), "--port", str(port), *flags],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(base_url, process, log)
        yield base_url
    finally:
        os.kill(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_up(base_url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise ConnectionError(f"minipaged serve did not come up at {base_url}; see {log}")


def format_report(report: ChaosReport) -> str:
    def ms(value):
        return "-" if value is None else f"{value:.0f} ms"

    served = sum(o.kind in GOOD and o.problem is None for o in report.outcomes)
    good = sum(o.kind in GOOD for o in report.outcomes)
    lines = [
        f"{'kind':<16}{'sent':>6}  statuses",
        *(
            f"{kind:<16}{sum(c.values()):>6}  "
            + ", ".join(
                f"{'none' if s is None else s}: {n}"
                for s, n in sorted(c.items(), key=lambda sn: -1 if sn[0] is None else sn[0])
            )
            for kind, c in report.statuses.items()
            if c
        ),
        "",
        f"requests        {len(report.outcomes)} in {report.duration_s:.1f} s",
        f"served          {served} of {good} good requests",
        f"unexpected      {len(report.unexpected)}",
        *(f"  {o.kind}: {o.problem}" for o in report.unexpected[:5]),
        f"blocks leaked   {report.blocks_leaked}",
        f"engine alive    {'yes' if report.alive else 'NO'}",
        f"good latency    p50 {ms(report.latency_ms(50))}, p99 {ms(report.latency_ms(99))}",
    ]
    return "\n".join(lines)


def save_report(path: str, report: ChaosReport) -> None:
    Path(path).write_text(json.dumps(report.as_dict(), indent=1))


def failed(report: ChaosReport) -> bool:
    """Whether the server broke a rule: anything unexpected, a leak, or a dead engine."""
    return bool(report.unexpected) or report.blocks_leaked != 0 or not report.alive


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--base-url", help="a running server (default: start one)")
    parser.add_argument(
        "--num-requests", type=int, default=400, metavar="N", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=32,
        metavar="N",
        help="clients at once (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the mix and the prompts")
    parser.add_argument(
        "--huge-bytes",
        type=int,
        metavar="B",
        help="the oversized body's size: one over the server's cap "
        "(default: 1 MiB + 1 for the server started here, else "
        "8 MiB + 1, the default cap)",
    )
    parser.add_argument("--json", help="also write the report here")


def main(args) -> None:
    def attack(base_url: str, huge_bytes: int) -> ChaosReport:
        return run(
            base_url, args.num_requests, args.concurrency, args.seed, args.huge_bytes or huge_bytes
        )

    if args.base_url:
        report = attack(args.base_url, 8 * 2**20 + 1)
    else:
        with local_server(max_body_bytes=2**20) as base_url:
            report = attack(base_url, 2**20 + 1)
    print(format_report(report))
    if args.json:
        save_report(args.json, report)
    if failed(report):
        raise SystemExit(1)
