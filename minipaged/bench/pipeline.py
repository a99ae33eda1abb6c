"""The pipeline's timeline, measured: what each stage did and when it idled (the
bubble), the time in point-to-point ops, the bytes between stages, and what those bytes
would cost on a GPU node's interconnect.

Every rank records its compute (``"forward"``) and its waits in ``send`` and ``recv``
(`minipaged.distributed.parallel_state.TIMELINE`); the multi-process executor's
``timelines`` gathers them.  A stage's lane is its first tensor-parallel
rank's.  The **bubble fraction** is GPipe's measure (Huang et al. 2019, §2.2): of the
stages' time from the first event to the last, the share no stage computed,
``1 - sum(busy) / (stages * window)``; the driver's scheduling and sampling count as
idle on stage 0's lane, as a GPU waiting for its host idles.

The projection puts the measured bytes per step on a link: its latency plus the bytes
over its bandwidth.  ``INTERCONNECTS`` names each with its source; the latencies are
those NCCL's own cost model charges a small message (``src/graph/tuning.cc``, the ring
algorithm's low-latency protocol: a base of 3.6 us, plus 0.47 us per NVLink hop and 2.7
us per network hop).  It stays a lower bound (no protocol overhead beyond the model's),
for activations of the width measured here; a larger model sends ``hidden_size * dtype
bytes`` per token per stage boundary.
"""

from __future__ import annotations

NCCL_BASE_LATENCY_S = 3.6e-6
"""What NCCL's cost model charges any message before its hops (``src/graph/tuning.cc``)."""

# Bytes per second one direction, seconds per hop, and where the numbers come from.
INTERCONNECTS = {
    "InfiniBand NDR 400 Gb/s (between nodes)": (
        400e9 / 8,
        2.7e-6,
        "NVIDIA ConnectX-7 product brief: 400 Gb/s NDR InfiniBand per port; "
        "NCCL's tuning model: 2.7 us per network hop",
    ),
    "NVLink 4 (inside an H100 node)": (
        450e9,
        0.47e-6,
        "NVIDIA H100 datasheet: 900 GB/s NVLink bidirectional, 450 GB/s each way; "
        "NCCL's tuning model: 0.47 us per NVLink hop",
    ),
}


def stage_lanes(timelines: list[dict], tp_size: int) -> list[list[tuple[str, float, float]]]:
    """Each stage's events (its first tensor-parallel rank's), from every rank's
    timeline in global rank order (rank = stage * tp_size + tp_rank)."""
    return [t["events"] for t in timelines[::tp_size]]


def pipeline_stats(
    timelines: list[dict], tp_size: int, num_steps: int, keep_events: int = 400
) -> dict:
    """The bubble, the point-to-point time and the bytes of ``num_steps`` steps, and
    each stage's first ``keep_events`` events (`plot_timeline`'s)."""
    lanes = stage_lanes(timelines, tp_size)
    events = [e for lane in lanes for e in lane]
    start = min(s for _, s, _ in events)
    window = max(e for _, _, e in events) - start
    busy = [sum(e - s for kind, s, e in lane if kind == "forward") for lane in lanes]
    p2p = [sum(e - s for kind, s, e in lane if kind != "forward") for lane in lanes]
    bytes_sent = [t["bytes_sent"] for t in timelines[::tp_size]]
    return {
        "num_stages": len(lanes),
        "num_steps": num_steps,
        "window_s": window,
        "busy_fraction_per_stage": [b / window for b in busy],
        "bubble_fraction": 1 - sum(busy) / (len(lanes) * window),
        "p2p_ms_per_step_per_stage": [1e3 * t / num_steps for t in p2p],
        # Activations stage to stage, and the last stage's logits back to the driver.
        "activation_bytes_per_step": sum(bytes_sent[:-1]) / num_steps,
        "logit_bytes_per_step": bytes_sent[-1] / num_steps,
        "first_events": [lane[:keep_events] for lane in lanes],
    }


def projection(bytes_per_step: float, hops: int = 1) -> dict[str, dict]:
    """Microseconds per step that ``bytes_per_step`` take on each of `INTERCONNECTS`,
    sent over ``hops`` steps of the link in turn (a hand-over between stages: 1; a ring
    all-reduce over 2 ranks: 2, each of half the bytes): the latency, the transfer, and
    their sum (``us_per_step``)."""
    costs = {}
    for name, (bandwidth, hop_s, source) in INTERCONNECTS.items():
        latency_us = 1e6 * (NCCL_BASE_LATENCY_S + hops * hop_s)
        transfer_us = 1e6 * bytes_per_step / bandwidth
        costs[name] = {
            "latency_us": latency_us,
            "transfer_us": transfer_us,
            "us_per_step": latency_us + transfer_us,
            "source": source,
        }
    return costs


def plot_timeline(ax, lanes: list[list[tuple[str, float, float]]], window_s: float | None = None):
    """Each stage's lane, time running right: its compute as solid bars, its waits in
    ``recv`` and ``send`` outlined, the gaps idle; only the first ``window_s`` seconds
    (None: all; a whole run is too dense to read).  Returns the bars drawn, by lane:
    ``[(kind, start_ms, width_ms), ...]``."""
    start = min(s for lane in lanes for _, s, _ in lane)
    end = start + window_s if window_s else max(e for lane in lanes for _, _, e in lane)
    style = {
        "forward": dict(color="tab:blue"),
        "recv": dict(facecolor="none", edgecolor="tab:orange"),
        "send": dict(facecolor="none", edgecolor="tab:green"),
    }
    drawn = []
    for row, lane in enumerate(lanes):
        bars = [(k, 1e3 * (s - start), 1e3 * (e - s)) for k, s, e in lane if s < end]
        for kind in style:
            spans = [(x, w) for k, x, w in bars if k == kind]
            ax.broken_barh(spans, (row - 0.4, 0.8), label=kind if row == 0 else None, **style[kind])
        drawn.append(bars)
    ax.set_yticks(range(len(lanes)), [f"stage {s}" for s in range(len(lanes))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize="small")
    return drawn
