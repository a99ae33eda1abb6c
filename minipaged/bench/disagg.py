"""``minipaged bench disagg``: disaggregated prefill against one engine with chunked
prefill, on the same cores (DistServe, Zhong et al., OSDI 2024, §2; vLLM's
``benchmarks/disagg_benchmarks``).

The workload mixes two kinds of request:

- **steady streams**: ``num_streams`` short prompts decoding long outputs, each replaced
  by a new one when it finishes, so that a decode batch runs the whole time;
- **bursts**: every ``burst_interval_s`` seconds (the first after ``quiet_s``),
  ``burst_size`` long prompts arrive together, each asking for a few tokens.

It runs twice, through two setups, each engine a process of its own (a
`DataParallelEngine` of one replica) driven from here:

- **single**: one engine on ``num_threads`` cores (a torch thread each); a burst's
  prompts are cut into chunks of at most ``max_num_batched_tokens`` tokens a step,
  beside the streams' decodes (chunked prefill), so every decode step of a burst's
  time carries a chunk;
- **disagg**: a prefill engine (``kv_producer``) on half of those cores and a decode
  engine (``kv_consumer``) on the other half, a torch thread per core.  Each request
  goes to the prefill engine with ``max_tokens=1``, then to the decode engine, whose
  `P2pTcpConnector` pulls the prompt's KV over loopback TCP and decodes: the steps of
  `minipaged disagg-proxy`, without its HTTP (which both setups would pay).

The same cores in both (by default 2: one engine on 2 threads against two engines on 1
each), each engine pinned to its own (``sched_setaffinity``): what disaggregation buys
is a decode engine whose core no prefill ever takes, and what it costs is that each
phase gets half the machine; giving the two engines more cores than the single one
would measure the extra cores instead.

Reported per setup, from the times the tokens arrived here: TTFT (arrival to first
token) of the streams and of the bursts' prompts, ITL (the gaps between a stream's
tokens) p50 and p99, and the streams' ITL p99 *during bursts* (gaps that overlap a
burst's window, from its prompts' arrival to the last one's first token: while its
prompts are being prefilled) against *without* (the other gaps).  The issue's goal is
a ratio within 1.3x for disaggregation; the single engine's is measured beside it.
The decode engine's connector counts what it pulled: the KV that landed in its cache
(tokens loaded x the cache's bytes per token), the bytes received (the same: only the
blocks loaded cross the wire, raw) and the seconds spent receiving them, whose
rate is set against a plain TCP transfer over loopback measured in the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from minipaged.arg_utils import DEFAULT_MODEL, add_model_flag
from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column
from minipaged.config import EngineConfig
from minipaged.core.memory.block_table import blocks_for
from minipaged.models.hub import resolve_model
from minipaged.models.loader import read_config
from minipaged.sampling_params import RequestOutputKind, SamplingParams

NAME = "disagg"
HELP = "disaggregated prefill vs one engine: decode ITL during prompt bursts, TTFT, KV moved"
DESCRIPTION = (
    "Steady decode streams plus bursts of long prompts, through one engine with chunked "
    "prefill and through a prefill engine and a decode engine (P2pTcpConnector) on the "
    "same cores: TTFT and ITL percentiles, decode ITL p99 during bursts against without, "
    "the KV bytes moved and their rate against loopback TCP's."
)
SETUPS = ("single", "disagg")
GOAL = 1.3  # the issue's: decode ITL p99 during bursts within 1.3x of without
LOOPBACK_BYTES = 64 << 20  # one plain TCP transfer over loopback, best of LOOPBACK_ROUNDS
LOOPBACK_ROUNDS = 3
STATS_SETTLE_S = 0.3  # an engine publishes its counters every 0.05 s (data_parallel)


@dataclass(frozen=True)
class Workload:
    """The mixed workload's shape (see the module docstring)."""

    num_streams: int = 4
    stream_prompt_len: int = 32
    stream_output_len: int = 64
    num_bursts: int = 3
    burst_size: int = 2
    burst_prompt_len: int = 256
    burst_output_len: int = 8
    quiet_s: float = 3.0
    burst_interval_s: float = 5.0

    def __post_init__(self) -> None:
        for name in (
            "num_streams",
            "stream_prompt_len",
            "stream_output_len",
            "num_bursts",
            "burst_size",
            "burst_prompt_len",
            "burst_output_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("quiet_s", "burst_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")

    @property
    def duration_s(self) -> float:
        """Streams are replaced until then: the last burst gets a whole interval."""
        return self.quiet_s + self.num_bursts * self.burst_interval_s

    def burst_times(self) -> list[float]:
        return [self.quiet_s + k * self.burst_interval_s for k in range(self.num_bursts)]


@dataclass
class Record:
    """One request as seen here: its kind, burst, prompt length, arrival, when each
    output carrying new tokens arrived (``time.perf_counter()`` seconds) and how many
    tokens it made in all.  An output late to be read carries several tokens: it
    counts as one arrival, as a chunk does in vLLM's benchmark_serving."""

    kind: str  # "stream" or "burst"
    burst: int | None
    prompt_len: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    def gaps(self) -> list[tuple[float, float]]:
        return list(itertools.pairwise(self.token_times))


# -- the engines ----------------------------------------------------------------------
@contextlib.contextmanager
def pinned(cores: list[int]):
    """Engines spawned inside run on ``cores`` only (they inherit this process's
    affinity), torch on one thread per core (``OMP_NUM_THREADS``, read when they
    import torch); then this process is as before."""
    before = os.environ.get("OMP_NUM_THREADS"), common.usable_cores()
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        if before[0] is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before[0]
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, before[1])


def engine_cores(setup: str, num_threads: int) -> dict[str, list[int]]:
    """The cores of each engine of ``setup``: the single engine's ``num_threads``, or
    half of them each for the prefill engine and the decode engine (the same cores in
    all, so that neither setup gets more of the machine)."""
    cores = common.usable_cores()[:num_threads]
    if setup == "single":
        return {"decode": cores}
    half = max(1, len(cores) // 2)
    return {"prefill": cores[:half], "decode": cores[-half:]}


def p2p(role: str, port: int) -> dict:
    return {
        "kv_connector": "P2pTcpConnector",
        "kv_role": role,
        "kv_ip": "127.0.0.1",
        "kv_port": port,
        "kv_connector_extra_config": {"connect_timeout_s": 60},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Setup:
    """The engines of one setup and how a request goes through them."""

    def __init__(self, name: str, path, engine_kwargs: dict, num_threads: int) -> None:
        from minipaged.server.data_parallel import DataParallelEngine

        self.name, self.engines = name, {}
        self.cores = engine_cores(name, num_threads)
        port = free_port()
        try:
            for side, cores in self.cores.items():
                kwargs = dict(engine_kwargs)
                if name == "disagg":
                    role = "kv_producer" if side == "prefill" else "kv_consumer"
                    kwargs["kv_transfer_config"] = p2p(role, port)
                with pinned(cores):
                    config = EngineConfig(model=str(path), **kwargs)
                    self.engines[side] = DataParallelEngine(config, 1)
        except BaseException:
            self.shutdown()
            raise

    async def run(self, request_id: str, prompt: list[int], params, record: Record) -> None:
        """Prefill first where there is a prefill engine (its one token dropped, as
        the proxy does), then stream from the decode engine into ``record``."""
        if "prefill" in self.engines:
            first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            stream = await self.engines["prefill"].generate(
                [(f"{request_id}-prefill", prompt, first, None, None)]
            )
            async for _ in stream:
                pass
        params = replace(params, output_kind=RequestOutputKind.DELTA)  # as a server streams
        stream = await self.engines["decode"].generate([(request_id, prompt, params, None, None)])
        async for output in stream:  # each output the tokens of one step (DELTA)
            if count := len(output.outputs[0].token_ids):
                record.token_times.append(time.perf_counter())
                record.num_tokens += count

    def stats(self) -> dict[str, dict]:
        """Each engine's last published counters."""
        return {side: dict(e.replicas[0].stats) for side, e in self.engines.items()}

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()


# -- the workload ---------------------------------------------------------------------
def prompt(vocab_size: int, length: int, tag: str, seed: int) -> list[int]:
    """Random token ids, distinct per ``tag`` (no prefix-cache hits between requests)."""
    rng = random.Random(f"{seed}-{tag}")
    return [rng.randrange(vocab_size) for _ in range(length)]


async def run_workload(setup: Setup, workload: Workload, vocab_size: int, seed: int, tag: str):
    """The mixed workload through ``setup``; every request's `Record`."""
    w, records = workload, []
    start = time.perf_counter()
    greedy = dict(temperature=0, ignore_eos=True)

    async def one(kind, burst, rid, length, output_len):
        record = Record(kind, burst, length, time.perf_counter())
        records.append(record)
        params = SamplingParams(max_tokens=output_len, **greedy)
        await setup.run(f"{tag}-{rid}", prompt(vocab_size, length, rid, seed), params, record)

    async def stream(i: int) -> None:
        for n in itertools.count():
            if time.perf_counter() - start >= w.duration_s:
                return
            await one("stream", None, f"s{i}-{n}", w.stream_prompt_len, w.stream_output_len)

    async def burst(k: int, at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        await asyncio.gather(
            *(
                one("burst", k, f"b{k}-{j}", w.burst_prompt_len, w.burst_output_len)
                for j in range(w.burst_size)
            )
        )

    await asyncio.gather(
        *(stream(i) for i in range(w.num_streams)),
        *(burst(k, at) for k, at in enumerate(w.burst_times())),
    )
    return records


async def warm_up(setup: Setup, vocab_size: int, workload: Workload, seed: int) -> None:
    """One short and one long request (kernels built, buffers sized), not timed."""
    for length in (workload.stream_prompt_len, workload.burst_prompt_len):
        record = Record("warm-up", None, length, time.perf_counter())
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        await setup.run(
            f"warm-{length}", prompt(vocab_size, length, f"w{length}", seed), params, record
        )


async def measure(setup: Setup, workload: Workload, vocab_size: int, seed: int):
    """Warm ``setup`` up, then time the workload through it: the records, and its
    engines' counters before and after."""
    await warm_up(setup, vocab_size, workload, seed)
    await asyncio.sleep(STATS_SETTLE_S)
    before = setup.stats()
    records = await run_workload(setup, workload, vocab_size, seed, setup.name)
    await asyncio.sleep(STATS_SETTLE_S)
    return records, before, setup.stats()


# -- the metrics ----------------------------------------------------------------------
def burst_windows(records: list[Record]) -> list[tuple[float, float]]:
    """Per burst: its first prompt's arrival to its last prompt's first token."""
    bursts: dict[int, list[Record]] = {}
    for r in records:
        if r.kind == "burst":
            bursts.setdefault(r.burst, []).append(r)
    return [
        (min(r.arrival for r in rs), max(r.token_times[0] for r in rs))
        for _, rs in sorted(bursts.items())
    ]


def split_gaps(records: list[Record], windows) -> tuple[list[float], list[float]]:
    """The streams' token gaps (seconds) that overlap no burst window, and those that
    overlap one."""
    quiet, during = [], []
    for r in records:
        if r.kind != "stream":
            continue
        for a, b in r.gaps():
            overlaps = any(a < end and b > begin for begin, end in windows)
            (during if overlaps else quiet).append(b - a)
    return quiet, during


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 in milliseconds (numpy's linear interpolation, as vLLM's
    benchmark_serving); None for no values."""
    if not values:
        return {"p50": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q)) * 1e3 for q in (50, 99)}


def setup_row(setup: str, records: list[Record], before: dict, after: dict, cores: dict) -> dict:
    """One setup's row: latencies from ``records``, and what the decode engine's
    connector pulled (counters ``after`` minus ``before`` the timed run)."""
    windows = burst_windows(records)
    quiet, during = split_gaps(records, windows)
    streams = [r for r in records if r.kind == "stream"]
    ttft = {
        kind: percentiles_ms([r.ttft for r in records if r.kind == kind])
        for kind in ("stream", "burst")
    }
    itl = percentiles_ms([b - a for r in streams for a, b in r.gaps()])
    quiet_ms, during_ms = percentiles_ms(quiet), percentiles_ms(during)

    def delta(side: str, key: str) -> float:
        return after.get(side, {}).get(key, 0) - before.get(side, {}).get(key, 0)

    loaded = delta("decode", "num_external_computed_tokens")
    received = delta("decode", "kv_connector_bytes_received")
    recv_s = delta("decode", "kv_connector_recv_seconds")
    return {
        "setup": setup,
        "engines": len(cores),
        "cores": cores,  # each engine's, one torch thread per core
        "torch_threads": {side: len(c) for side, c in cores.items()},
        "num_requests": len(records),
        "num_stream_requests": len(streams),
        "output_tokens": sum(r.num_tokens for r in records),
        "ttft_stream_p50_ms": ttft["stream"]["p50"],
        "ttft_stream_p99_ms": ttft["stream"]["p99"],
        "ttft_burst_p50_ms": ttft["burst"]["p50"],
        "ttft_burst_p99_ms": ttft["burst"]["p99"],
        "itl_p50_ms": itl["p50"],
        "itl_p99_ms": itl["p99"],
        "itl_quiet_p99_ms": quiet_ms["p99"],
        "itl_burst_p99_ms": during_ms["p99"],
        "itl_burst_ratio": (during_ms["p99"] / quiet_ms["p99"] if quiet and during else None),
        "itl_quiet_samples": len(quiet),
        "itl_burst_samples": len(during),
        "burst_windows_s": [(b - records[0].arrival, e - records[0].arrival) for b, e in windows],
        "kv_tokens_loaded": loaded,
        "kv_bytes_loaded": loaded * after.get("decode", {}).get("kv_cache_bytes_per_token", 0),
        "kv_bytes_received": received,
        "kv_recv_s": recv_s,
        "kv_transfer_bytes_per_s": received / recv_s if recv_s else None,
        "records": [asdict(r) for r in records],
    }


# -- the link -------------------------------------------------------------------------
def loopback_bandwidth(num_bytes: int = LOOPBACK_BYTES, rounds: int = LOOPBACK_ROUNDS) -> float:
    """Bytes per second of a plain TCP transfer over loopback (a thread receives what
    this one sends, 1 MiB at a time), the best of ``rounds``."""
    return max(num_bytes / _transfer_seconds(num_bytes) for _ in range(rounds))


def _transfer_seconds(num_bytes: int) -> float:
    """Seconds from the first byte sent to the last one received, over loopback."""
    chunk = bytes(1 << 20)
    with socket.create_server(("127.0.0.1", 0)) as server:
        done = threading.Event()

        def receive():
            conn, _ = server.accept()
            with conn:
                buffer, left = bytearray(len(chunk)), num_bytes
                while left:
                    left -= conn.recv_into(buffer, min(left, len(buffer)))
            done.set()

        receiver = threading.Thread(target=receive, daemon=True)
        receiver.start()
        with socket.create_connection(server.getsockname()) as conn:
            start = time.perf_counter()
            for sent in range(0, num_bytes, len(chunk)):
                conn.sendall(chunk[: min(len(chunk), num_bytes - sent)])
            done.wait()
            seconds = time.perf_counter() - start
        receiver.join()
    return seconds


# -- the benchmark --------------------------------------------------------------------
def bench_disagg(
    model: str = DEFAULT_MODEL,
    workload: Workload | None = None,
    num_threads: int = 2,
    max_num_batched_tokens: int = 256,
    block_size: int = 16,
    setups=SETUPS,
    seed: int = 0,
) -> dict:
    """Both setups over ``workload``; the rows and the loopback link's bandwidth."""
    workload = workload or Workload()
    common.check_num_threads(num_threads)
    if unknown := [s for s in setups if s not in SETUPS]:
        raise ValueError(f"setups must be among {list(SETUPS)}, got {unknown[0]!r}")
    path = resolve_model(model)
    config = read_config(path)
    w = workload
    per_burst = w.burst_size * (w.burst_prompt_len + w.burst_output_len)
    per_streams = w.num_streams * (w.stream_prompt_len + w.stream_output_len)
    engine_kwargs = dict(
        block_size=block_size,
        # Room for every stream and two bursts at once, twice over (the prefix cache).
        num_gpu_blocks=2 * blocks_for(per_streams + 2 * per_burst, block_size) + 8,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max(w.burst_prompt_len + w.burst_output_len, 256),
        swap_space=0,
        seed=seed,
    )
    link = loopback_bandwidth()
    rows = []
    for name in setups:
        setup = Setup(name, path, engine_kwargs, num_threads)
        try:
            cores = setup.cores
            records, before, after = asyncio.run(measure(setup, w, config.vocab_size, seed))
        finally:
            setup.shutdown()
        rows.append(setup_row(name, records, before, after, cores))
    return {
        "rows": rows,
        "loopback_bytes_per_s": link,
        "engine_kwargs": engine_kwargs,
        "workload": asdict(workload),
        "goal": GOAL,
    }


# -- tables and the figure ------------------------------------------------------------
def format_table(rows: list[dict]) -> str:
    return common.format_table(
        rows,
        [
            Column("setup", "setup"),
            Column("threads", lambda r: "+".join(str(t) for t in r["torch_threads"].values())),
            Column("TTFT burst p50 ms", "ttft_burst_p50_ms", "{:.0f}"),
            Column("TTFT burst p99 ms", "ttft_burst_p99_ms", "{:.0f}"),
            Column("TTFT stream p99 ms", "ttft_stream_p99_ms", "{:.0f}"),
            Column("ITL p50 ms", "itl_p50_ms", "{:.1f}"),
            Column("ITL p99 ms", "itl_p99_ms", "{:.1f}"),
            Column("ITL p99 quiet", "itl_quiet_p99_ms", "{:.1f}"),
            Column("ITL p99 burst", "itl_burst_p99_ms", "{:.1f}"),
            Column("burst/quiet", "itl_burst_ratio", "{:.2f}x"),
            Column("KV MB moved", lambda r: r["kv_bytes_received"] / 1e6, "{:.1f}"),
            Column(
                "KV MB/s",
                lambda r: r["kv_transfer_bytes_per_s"] and r["kv_transfer_bytes_per_s"] / 1e6,
                "{:.0f}",
            ),
        ],
    )


def plot_disagg(result: dict, title: str):
    """Four panels: the streams' ITL p99 without and during bursts per setup (the
    goal's line at 1.3x the quiet value); the bursts' TTFT; each setup's stream gaps
    over time with the burst windows shaded; the KV transfer's rate against the
    loopback link's.  A matplotlib ``Figure``, no pyplot."""
    from matplotlib.figure import Figure

    rows = result["rows"]
    fig = Figure(figsize=(12, 7.5), layout="constrained")
    (itl_ax, ttft_ax), (time_ax, rate_ax) = fig.subplots(2, 2)
    x = np.arange(len(rows))
    for offset, key, label in ((-0.2, "itl_quiet_p99_ms", "without bursts"),
                               (0.2, "itl_burst_p99_ms", "during bursts")):  # fmt: skip
        bars = itl_ax.bar(x + offset, [r[key] or 0 for r in rows], 0.4, label=label)
        itl_ax.bar_label(bars, fmt="%.0f", fontsize="small")
    for i, r in enumerate(rows):
        if r["itl_quiet_p99_ms"]:
            goal = result["goal"] * r["itl_quiet_p99_ms"]
            itl_ax.hlines(goal, i - 0.4, i + 0.4, colors="k", linestyles="--")
    itl_ax.set_xticks(x, [f"{r['setup']}\n{_ratio(r)}" for r in rows])
    itl_ax.set_ylabel("streams' ITL p99 (ms)")
    itl_ax.set_title(f"decode ITL p99 (dashed: {result['goal']}x without bursts)")
    itl_ax.legend(fontsize="small")
    for offset, key, label in ((-0.2, "ttft_burst_p50_ms", "p50"),
                               (0.2, "ttft_burst_p99_ms", "p99")):  # fmt: skip
        bars = ttft_ax.bar(x + offset, [r[key] or 0 for r in rows], 0.4, label=label)
        ttft_ax.bar_label(bars, fmt="%.0f", fontsize="small")
    ttft_ax.set_xticks(x, [r["setup"] for r in rows])
    ttft_ax.set_ylabel("TTFT of the bursts' prompts (ms)")
    ttft_ax.set_title("time to first token, long prompts")
    ttft_ax.legend(fontsize="small")
    for r, color in zip(rows, ("tab:red", "tab:green", "tab:blue")):
        origin = min(rec["arrival"] for rec in r["records"])
        points = [
            (b - origin, (b - a) * 1e3)
            for rec in r["records"]
            if rec["kind"] == "stream"
            for a, b in itertools.pairwise(rec["token_times"])
        ]
        time_ax.plot(*zip(*points), ".", ms=3, color=color, label=r["setup"])
        for begin, end in r["burst_windows_s"]:
            time_ax.axvspan(begin, end, color=color, alpha=0.12)
    time_ax.set_yscale("log")
    time_ax.set_xlabel("seconds into the run (shaded: burst windows)")
    time_ax.set_ylabel("stream token gap (ms)")
    time_ax.set_title("every decode gap of the steady streams")
    time_ax.legend(fontsize="small")
    moved = [r for r in rows if r["kv_transfer_bytes_per_s"]]
    labels = ["loopback TCP"] + [f"KV pulls ({r['setup']})" for r in moved]
    rates = [result["loopback_bytes_per_s"]] + [r["kv_transfer_bytes_per_s"] for r in moved]
    bars = rate_ax.bar(
        labels, [v / 1e6 for v in rates], color=["grey"] + ["tab:green"] * len(moved)
    )
    rate_ax.bar_label(bars, fmt="%.0f", fontsize="small")
    rate_ax.set_yscale("log")
    rate_ax.set_ylabel("MB/s")
    rate_ax.set_title("the KV's transfer rate against the link's")
    fig.suptitle(title)
    return fig


def _ratio(row: dict) -> str:
    ratio = row["itl_burst_ratio"]
    return "-" if ratio is None else f"{ratio:.2f}x"


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, DEFAULT_MODEL, DEFAULT_MODEL)
    defaults = Workload()
    group = parser.add_argument_group("workload")
    for name, value in asdict(defaults).items():
        group.add_argument(
            f"--{name.replace('_', '-')}", type=type(value), default=value,
            help="(default: %(default)s)",
        )  # fmt: skip
    parser.add_argument(
        "--num-threads", type=int, default=2,
        help="cores (a torch thread each) of the single engine; each disaggregated "
        "engine gets half (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=256,
        help="tokens a step may run: the single engine's prefill chunk (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    add_output_flags(parser, NAME)


def main(args) -> None:
    workload = Workload(**{name: getattr(args, name) for name in asdict(Workload())})
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    result = bench_disagg(
        args.model,
        workload,
        args.num_threads,
        args.max_num_batched_tokens,
        args.block_size,
        args.setups,
    )
    print(format_table(result["rows"]))
    print(f"loopback TCP: {result['loopback_bytes_per_s'] / 1e6:.0f} MB/s")
    title = (
        f"disaggregated prefill vs one engine, {args.model} on a CPU "
        f"({args.num_threads} cores each way)"
    )
    write(
        args,
        NAME,
        "cpu",
        result["rows"],
        plot_disagg(result, title),
        model=args.model,
        **{k: v for k, v in result.items() if k != "rows"},
        load_average_before=load,
        load_average_after=list(os.getloadavg()) if load is not None else None,
    )
