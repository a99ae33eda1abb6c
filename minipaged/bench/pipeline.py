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

The projection divides the measured bytes per step by a link's bandwidth:
``INTERCONNECTS`` names each with its source.  It is a lower bound on the transfer
time (no latency, no protocol overhead), for activations of the width measured here; a
larger model sends ``hidden_size * dtype bytes`` per token per stage boundary.
"""

from __future__ import annotations

# Bytes per second, one direction, with where the number comes from.
INTERCONNECTS = {
    "InfiniBand NDR 400 Gb/s (between nodes)": (
        400e9 / 8,
        "NVIDIA ConnectX-7 product brief: 400 Gb/s NDR InfiniBand per port",
    ),
    "NVLink 4 (inside an H100 node)": (
        450e9,
        "NVIDIA H100 datasheet: 900 GB/s NVLink bidirectional, 450 GB/s each way",
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


def projection(bytes_per_step: float) -> dict[str, dict]:
    """Microseconds per step that ``bytes_per_step`` take on each of `INTERCONNECTS`."""
    return {
        name: {"us_per_step": 1e6 * bytes_per_step / bandwidth, "source": source}
        for name, (bandwidth, source) in INTERCONNECTS.items()
    }


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
