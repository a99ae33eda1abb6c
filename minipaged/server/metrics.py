"""``GET /metrics``: the engine's counters in Prometheus's text format, named as vLLM's.

The values are the engine thread's last published ``stats`` (`AsyncEngine.stats`), read
at scrape time by a custom collector, so a scrape never touches the engine itself.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minipaged.server.async_engine import AsyncEngine

GAUGE, COUNTER = GaugeMetricFamily, CounterMetricFamily
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_"
# name (after "minipaged:"), kind, help, value from the stats dict.
METRICS = [
    ("num_requests_running", GAUGE, "Requests in the running batch.", lambda s: s["num_running"]),
    (
        "num_requests_waiting",
        GAUGE,
        "Requests waiting to start, or to be recomputed.",
        lambda s: s["num_waiting"],
    ),
    (
        "num_requests_swapped",
        GAUGE,
        "Requests preempted by swapping, their KV on the CPU.",
        lambda s: s["num_swapped"],
    ),
    (
        "kv_blocks_used",
        GAUGE,
        "GPU KV cache blocks held by sequences.",
        lambda s: s["num_gpu_blocks"] - s["num_free_gpu_blocks"],
    ),
    (
        "kv_blocks_free",
        GAUGE,
        "GPU KV cache blocks free (evictable prefix-cache blocks count).",
        lambda s: s["num_free_gpu_blocks"],
    ),
    (
        "kv_cache_bytes",
        GAUGE,
        "Bytes of the GPU KV pool: its blocks times a block's bytes in kv_cache_dtype.",
        lambda s: s["num_gpu_blocks"] * s["kv_cache_block_bytes"],
    ),
    (
        "cpu_kv_blocks_used",
        GAUGE,
        "CPU swap blocks holding swapped-out KV.",
        lambda s: s["num_cpu_blocks"] - s["num_free_cpu_blocks"],
    ),
    (
        "prefix_cache_hit_rate",
        GAUGE,
        "Share of looked-up prompt blocks found in the prefix cache.",
        lambda s: s["prefix_cache_hit_rate"],
    ),
    (
        "num_preemptions",
        COUNTER,
        "Requests preempted (by recompute or swap).",
        lambda s: s["num_preemptions"],
    ),
    (
        "swapped_out_blocks",
        COUNTER,
        "KV blocks copied GPU -> CPU by swap-out.",
        lambda s: s["num_swapped_out_blocks"],
    ),
    (
        "swapped_in_blocks",
        COUNTER,
        "KV blocks copied CPU -> GPU by swap-in.",
        lambda s: s["num_swapped_in_blocks"],
    ),
    (
        "prompt_tokens",
        COUNTER,
        "Prompt tokens of every request added.",
        lambda s: s["num_prompt_tokens"],
    ),
    ("generation_tokens", COUNTER, "Tokens generated.", lambda s: s["num_generated_tokens"]),
    ("engine_steps", COUNTER, "Engine steps run, each one batch.", lambda s: s["num_steps"]),
]
# With speculative_config only: vLLM's spec_decode counters, under their names.
SPEC_DECODE_METRICS = [
    (
        "spec_decode_num_drafts",
        COUNTER,
        "Drafts verified: sequences that ran guesses in a step.",
        lambda s: s["spec_decode_num_drafts"],
    ),
    (
        "spec_decode_num_draft_tokens",
        COUNTER,
        "Guessed tokens verified.",
        lambda s: s["spec_decode_num_draft_tokens"],
    ),
    (
        "spec_decode_num_accepted_tokens",
        COUNTER,
        "Guessed tokens accepted.",
        lambda s: s["spec_decode_num_accepted_tokens"],
    ),
]


class EngineCollector:
    """A prometheus_client collector over the engine's published stats."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        speculates = "spec_decode_num_drafts" in stats
        for name, family, help_, value in METRICS + (SPEC_DECODE_METRICS if speculates else []):
            yield family(f"minipaged:{name}", help_, value=value(stats))
        if speculates:
            per_position = CounterMetricFamily(
                "minipaged:spec_decode_num_accepted_tokens_per_pos",
                "Guessed tokens accepted, by their position in the draft.",
                labels=["position"],
            )
            for key, value in stats.items():
                if key.startswith(PER_POSITION):
                    per_position.add_metric([key.removeprefix(PER_POSITION)], value)
            yield per_position
        if "expert_tokens_total" in stats:  # a mixture-of-experts model
            yield from routing_metrics(stats)


def routing_metrics(stats: dict):
    """The experts' load: the last step's imbalance, and the (token, choice) pairs each
    expert of each MoE layer has received, labelled by layer and expert."""
    yield GAUGE(
        "minipaged:expert_load_imbalance",
        "Last step: the busiest expert's tokens over the mean, averaged over MoE layers.",
        value=stats["expert_load_imbalance"],
    )
    tokens = COUNTER(
        "minipaged:expert_tokens",
        "Tokens routed to each expert (one per token and chosen expert).",
        labels=["layer", "expert"],
    )
    for layer, counts in enumerate(stats["expert_tokens_total"]):
        for expert, count in enumerate(counts):
            tokens.add_metric([str(layer), str(expert)], count)
    yield tokens


def make_registry(engine: AsyncEngine) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry
