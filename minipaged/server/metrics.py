"""``GET /metrics``: the engine's counters in Prometheus's text format, named as vLLM's.

The values are the engine thread's last published ``stats`` (`AsyncEngine.stats`), read
at scrape time by a custom collector, so a scrape never touches the engine itself.  With
data-parallel replicas, each replica's last published stats, labelled by its index
(``engine="0"``, as vLLM labels its engines): ``sum by (__name__)`` in PromQL gives the
server's totals.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minipaged.server.async_engine import AsyncEngine
from minipaged.server.data_parallel import DataParallelEngine

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
        "kv_cache_bytes_per_token",
        GAUGE,
        "Bytes one token's KV takes over every layer (keys and values per KV head, or "
        "one latent vector under multi-head latent attention).",
        lambda s: s["kv_cache_bytes_per_token"],
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
    (
        "computed_prompt_tokens",
        COUNTER,
        "Prompt tokens run through the model (neither in the prefix cache nor loaded).",
        lambda s: s["num_computed_prompt_tokens"],
    ),
    (
        "external_computed_tokens",
        COUNTER,
        "Prompt tokens a KV connector loaded from another engine instead of computing them.",
        lambda s: s["num_external_computed_tokens"],
    ),
    ("engine_steps", COUNTER, "Engine steps run, each one batch.", lambda s: s["num_steps"]),
    (
        "engine_steps_scheduled_ahead",
        COUNTER,
        "Engine steps scheduled while the step before them ran (async_scheduling).",
        lambda s: s["num_steps_ahead"],
    ),
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
    """A prometheus_client collector over the engine's published stats; with
    data-parallel replicas, every sample labelled by its replica's ``engine`` index (as
    vLLM labels them), ``minipaged:engine_alive`` saying which still run and
    ``minipaged:router_load`` what the router counts against each."""

    def __init__(self, engine: AsyncEngine | DataParallelEngine) -> None:
        self.engine = engine

    def collect(self):
        if not isinstance(self.engine, DataParallelEngine):
            yield from engine_metrics([self.engine.stats], [])
            return
        replicas = self.engine.replica_stats()
        alive = GAUGE(
            "minipaged:engine_alive",
            "1 while the data-parallel engine's process runs, 0 once it has died.",
            labels=["engine"],
        )
        load = GAUGE(
            "minipaged:router_load",
            "Requests the router sent to the engine that have not finished (what it routes by).",
            labels=["engine"],
        )
        for replica, _ in replicas:
            alive.add_metric([str(replica.index)], int(replica.alive))
            load.add_metric([str(replica.index)], replica.load)
        yield alive
        yield load
        live = [(str(replica.index), stats) for replica, stats in replicas if stats]
        yield from engine_metrics([stats for _, stats in live], [index for index, _ in live])


def engine_metrics(stats_list: list[dict], engines: list[str]):
    """One family per metric, a sample per engine's ``stats`` (labelled ``engine`` by
    ``engines``, or unlabelled for a lone engine, ``engines`` empty)."""
    labels = ["engine"] if engines else []
    label_values = [[e] for e in engines] if engines else [[]]
    first = stats_list[0] if stats_list else {}
    speculates = "spec_decode_num_drafts" in first
    for name, family, help_, value in METRICS + (SPEC_DECODE_METRICS if speculates else []):
        metric = family(f"minipaged:{name}", help_, labels=labels)
        for stats, values in zip(stats_list, label_values):
            metric.add_metric(values, value(stats))
        yield metric
    if speculates:
        per_position = CounterMetricFamily(
            "minipaged:spec_decode_num_accepted_tokens_per_pos",
            "Guessed tokens accepted, by their position in the draft.",
            labels=[*labels, "position"],
        )
        for stats, values in zip(stats_list, label_values):
            for key, count in stats.items():
                if key.startswith(PER_POSITION):
                    per_position.add_metric([*values, key.removeprefix(PER_POSITION)], count)
        yield per_position
    if "expert_tokens_total" in first:  # a mixture-of-experts model
        yield from routing_metrics(stats_list, labels, label_values)


def routing_metrics(stats_list: list[dict], labels: list[str], label_values: list[list[str]]):
    """The experts' load: the last step's imbalance, and the (token, choice) pairs each
    expert of each MoE layer has received, labelled by layer and expert."""
    imbalance = GAUGE(
        "minipaged:expert_load_imbalance",
        "Last step: the busiest expert's tokens over the mean, averaged over MoE layers.",
        labels=labels,
    )
    tokens = COUNTER(
        "minipaged:expert_tokens",
        "Tokens routed to each expert (one per token and chosen expert).",
        labels=[*labels, "layer", "expert"],
    )
    for stats, values in zip(stats_list, label_values):
        imbalance.add_metric(values, stats["expert_load_imbalance"])
        for layer, counts in enumerate(stats["expert_tokens_total"]):
            for expert, count in enumerate(counts):
                tokens.add_metric([*values, str(layer), str(expert)], count)
    yield imbalance
    yield tokens


def make_registry(engine: AsyncEngine | DataParallelEngine) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry
