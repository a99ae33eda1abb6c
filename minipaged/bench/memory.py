"""``minipaged bench memory``: where the KV cache goes, paged vs contiguous (paper §3
Fig. 2, §6.2 Fig. 13).

One synthetic workload (`workloads`: ShareGPT-like or Alpaca-like lengths) is served to
completion on one pool of KV slots, once per system (`memory.simulate`): paged blocks,
and the contiguous reservations of Orca (Max: every request reserves ``max_len`` slots;
Pow2: the next power of two above its final length; Oracle: exactly its final length).
These are counts, not times, so the benchmark runs anywhere in seconds.  The default
pool is the paper's: OPT-13B on an A100-40GB leaves room for about 15.7K tokens of KV
(§6.1), in fp16; ``--kv-cache-dtype`` fp8 or int8 (`minipaged.ops.kv_quant`) stores a
byte per element, so the same bytes hold about twice the tokens (`slots_for`).

The same bytes then hold DeepSeek-V2-Lite's KV cache (`latent_rows`): its multi-head
latent attention caches one latent vector a token and layer, against the same model
caching per-head keys and values with grouped-query attention (GQA) or without, and a
GQA model of its size (`minipaged.bench.mla`, lesson 21).

The paper's numbers: contiguous systems keep 20.4-38.2% of their KV memory as token
states, vLLM 96.3% (Fig. 2); on ShareGPT vLLM batches 2.2x more requests than Orca
Oracle and 4.3x more than Orca Max (Fig. 13).
"""

from __future__ import annotations

from matplotlib.figure import Figure

from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column
from minipaged.config import KV_CACHE_DTYPES
from minipaged.core.memory.simulate import OPT13B_A100_SLOTS, MemoryReport, simulate_systems
from minipaged.core.memory.workloads import MEMORY_NUM_REQUESTS, WORKLOADS, synthetic_requests
from minipaged.viz import draw_memory_shares

NAME = "memory"
HELP = "KV memory waste and batch size: paged vs contiguous (Fig. 2, 13)"
DESCRIPTION = (
    "Serve one synthetic workload on one KV pool with paged blocks and with "
    "Orca's contiguous Max, Pow2 and Oracle reservations; report the pool's "
    "shares (token states, reserved, internal and external fragmentation) "
    "and the mean number of requests resident.  Counts, not times."
)
SHARES = ("token_share", "reserved_share", "internal_share", "external_share")
# https://huggingface.co/facebook/opt-13b/blob/main/config.json: 40 layers of 40 heads of
# 128, the model whose fp16 KV the default pool holds.
OPT13B = dict(num_hidden_layers=40, num_key_value_heads=40, head_dim=128)


def pool_bytes(fp16_slots: int) -> int:
    """The bytes of ``fp16_slots`` tokens of OPT-13B's KV cache in fp16."""
    import torch  # here: the simulation and its tables run without torch

    from minipaged.bench.mla import config
    from minipaged.worker.cache_engine import block_bytes

    return fp16_slots * block_bytes(config(**OPT13B), 1, torch.float16)


def slots_for(fp16_slots: int, kv_cache_dtype: str) -> int:
    """The tokens that the bytes of ``fp16_slots`` fp16 tokens hold in ``kv_cache_dtype``:
    a byte per element for fp8 and int8, plus int8's float32 scale per token and head
    (`minipaged.worker.cache_engine.block_bytes`), for OPT-13B's heads of 128."""
    if kv_cache_dtype == "auto":
        return fp16_slots
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    from minipaged.bench.mla import config
    from minipaged.ops.kv_quant import FORMATS
    from minipaged.worker.cache_engine import block_bytes

    return pool_bytes(fp16_slots) // block_bytes(config(**OPT13B), 1, FORMATS[kv_cache_dtype])


def latent_rows(fp16_slots: int, kv_cache_dtype: str) -> list[dict] | None:
    """The pool's bytes (``fp16_slots`` fp16 tokens of OPT-13B) as DeepSeek-V2-Lite's KV
    cache in ``kv_cache_dtype`` (auto: fp16): the bytes per token of its latent cache
    against the same model caching per-head keys and values, grouped into fewer KV heads
    or not, and against a GQA model of its size (`minipaged.bench.mla.memory_rows`), and
    the tokens (``kv_slots``) each leaves room for.  None for int8, which the latent
    cache refuses."""
    if kv_cache_dtype == "int8":
        return None
    import torch

    from minipaged.bench.mla import memory_rows
    from minipaged.ops.kv_quant import cache_dtype

    dtype = cache_dtype(kv_cache_dtype, torch.float16)
    # A budget of the pool's bytes, in sequences of one token: the tokens it holds.
    rows = memory_rows(pool_bytes(fp16_slots) / 2**30, 1, dtype)
    return [
        {
            "cache": r["cache"],
            "bytes_per_token": r["bytes_per_token"],
            "latent_share": r["latent_share"],
            "kv_slots": r["sequences"],
        }
        for r in rows
    ]


LATENT_COLUMNS = [
    Column("KV cache", "cache"),
    Column("bytes/token", "bytes_per_token", "{:,}"),
    Column("latent / this", "latent_share", "{:.1%}"),
    Column("tokens in the pool", "kv_slots", "{:,}"),
]


def bench_memory(
    workload: str,
    num_requests: int,
    kv_slots: int = OPT13B_A100_SLOTS,
    block_size: int = 16,
    max_len: int = 2048,
    seed: int = 0,
) -> list[MemoryReport]:
    """Each system's report for the same ``num_requests`` seeded requests."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    requests = synthetic_requests(workload, num_requests, seed=seed, max_len=max_len)
    return simulate_systems(requests, kv_slots, block_size, max_len)


def systems(reports: list[MemoryReport]) -> dict[str, dict[str, float]]:
    """The ``bench memory`` JSON: system -> its shares and ``max_batch``."""
    return {
        r.system: {**{k: getattr(r, k) for k in SHARES}, "max_batch": r.max_batch} for r in reports
    }


def rows(reports: list[MemoryReport], workload: str) -> list[dict]:
    return [
        {
            "system": r.system,
            "workload": workload,
            **systems([r])[r.system],
            "free_share": r.free_share,
            "num_steps": r.num_steps,
            "num_preemptions": r.num_preemptions,
        }
        for r in reports
    ]


def format_table(reports: list[MemoryReport]) -> str:
    """Shares of the pool per state, the mean batch, and the batch relative to paged."""
    paged = next(r.max_batch for r in reports if r.system == "paged")
    return common.format_table(
        rows(reports, workload=None),
        [
            Column("system", "system"),
            Column("tokens", "token_share", "{:.1%}"),
            Column("reserved", "reserved_share", "{:.1%}"),
            Column("internal", "internal_share", "{:.1%}"),
            Column("external", "external_share", "{:.1%}"),
            Column("free", "free_share", "{:.1%}"),
            Column("batch", "max_batch", "{:.1f}"),
            Column("paged/this", lambda r: paged / r["max_batch"], "{:.1f}x"),
        ],
    )


def plot_memory(reports: list[MemoryReport], title: str) -> Figure:
    """Fig. 2 beside Fig. 13: the pool's shares per system, and the mean batch."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    shares, batch = fig.subplots(1, 2, width_ratios=[3, 2])
    draw_memory_shares(reports, ax=shares, title="where the KV cache goes (cf. Fig. 2)")
    names = [r.system for r in reports]
    bars = batch.bar(names, [r.max_batch for r in reports], color="#4c72b0")
    batch.bar_label(bars, fmt="%.1f", fontsize=8)
    batch.set_ylabel("mean requests resident")
    batch.set_title("batch size (cf. Fig. 13)")
    batch.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="sharegpt",
        help="request lengths like this dataset's (default: %(default)s)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=MEMORY_NUM_REQUESTS,
        metavar="N",
        help="(default: %(default)s, the course's workload)",
    )
    parser.add_argument(
        "--kv-slots",
        type=int,
        default=OPT13B_A100_SLOTS,
        metavar="N",
        help="tokens the KV pool holds (default: %(default)s, "
        "OPT-13B on an A100-40GB as in the paper)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        metavar="N",
        help="the paged system's (default: %(default)s)",
    )
    parser.add_argument(
        "--max-len",
        type=int,
        default=2048,
        metavar="N",
        help="the model's context: what Orca Max reserves (default: %(default)s)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="what the pool stores: auto (fp16, the paper's) or a byte per element "
        "(fp8, int8): --kv-slots fp16 tokens' bytes then hold about twice the tokens "
        "(default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_output_flags(parser, "memory-<workload>")


def main(args) -> None:
    kv_slots = slots_for(args.kv_slots, args.kv_cache_dtype)
    reports = bench_memory(
        args.workload, args.num_requests, kv_slots, args.block_size, args.max_len, args.seed
    )
    pool = f"{kv_slots} KV slots ({args.kv_cache_dtype})"
    print(f"{args.num_requests} {args.workload}-like requests on {pool}")
    print(format_table(reports))
    latent = latent_rows(args.kv_slots, args.kv_cache_dtype)
    if latent is None:
        print("\nDeepSeek-V2-Lite's latent cache has no int8 form: no latent rows")
    else:
        print(
            f"\nthe bytes of {args.kv_slots:,} fp16 tokens of OPT-13B "
            f"({pool_bytes(args.kv_slots) / 2**30:.1f} GiB) as DeepSeek-V2-Lite's KV cache "
            f"({args.kv_cache_dtype})"
        )
        print(common.format_table(latent, LATENT_COLUMNS))
    title = (
        f"{args.num_requests} {args.workload}-like requests, {pool}, blocks of {args.block_size}"
    )
    # Counts, not times: the same on any machine, so always under cpu/.
    write(
        args,
        f"memory-{args.workload}",
        "cpu",
        rows(reports, args.workload),
        plot_memory(reports, title),
        workload=args.workload,
        systems=systems(reports),
        kv_slots=kv_slots,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_len=args.max_len,
        num_requests=args.num_requests,
        seed=args.seed,
        latent_kv=latent,
    )
