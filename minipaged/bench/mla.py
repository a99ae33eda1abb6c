"""``minipaged bench mla``: multi-head latent attention's KV cache and its decode,
absorbed or not (DeepSeek-V2, Liu et al. 2024, §2.1 and Table 1).

Two measurements:

1. **bytes per token** of KV cache, from `minipaged.worker.cache_engine.block_bytes` on the
   real config.json values of DeepSeek-V2-Lite (`DEEPSEEK_V2_LITE`: 27 layers, a
   512-value latent and a 64-value RoPE key per token and layer), against the same
   model caching per-head keys and values (its 16 heads, and grouped into 8 or 2 KV
   heads), and against Qwen2.5-14B (`QWEN25_14B`), a GQA model of about its total size;
   then how many sequences of ``--seq-len`` tokens fit in ``--budget-gib`` of KV cache;
   and the paper's 93.3% against DeepSeek 67B (`paper_anchor`).  Counts, not times.
2. **decode time per step** of one DeepSeek-V2-Lite attention layer (16 heads, the
   latent 512 + 64) on the CPU kernels (``bench attention`` times the same on each
   backend, a GPU's too, at its decode shapes): absorbed (`minipaged.ops.mla.decode_absorbed`,
   ``kernels/cpu/mla_decode.cpp`` over the latents) against unabsorbed (every context's latents
   decompressed by ``kv_b_proj`` into per-head keys and values, then the paged decode
   kernel), at several context lengths, with the bytes each one's kernel reads.  The
   same metadata, the same cache, the same weights; each output checked against the
   other before it is timed.
"""

from __future__ import annotations

import functools
import types

import torch
from matplotlib.figure import Figure

from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, time_us
from minipaged.models.attention import AttentionMetadata
from minipaged.models.deepseek_v2 import MLAPagedAttention
from minipaged.ops.testing import assert_close
from minipaged.worker.cache_engine import block_bytes

NAME = "mla"
HELP = "latent attention: KV bytes per token against GQA, absorbed vs unabsorbed decode"
DESCRIPTION = (
    "Bytes per token of DeepSeek-V2-Lite's latent KV cache against the same model's "
    "per-head cache and a GQA model of similar size, and the sequences one KV budget "
    "holds; then one DeepSeek-V2-Lite attention layer's decode step on the CPU, "
    "absorbed against unabsorbed, at several context lengths."
)

# https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json
DEEPSEEK_V2_LITE = dict(
    num_hidden_layers=27,
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
# https://huggingface.co/Qwen/Qwen2.5-14B/blob/main/config.json (14.7B parameters;
# DeepSeek-V2-Lite has 15.7B, 2.4B of them active a token).
QWEN25_14B = dict(
    num_hidden_layers=48, hidden_size=5120, num_attention_heads=40, num_key_value_heads=8
)
# The paper's anchor, "the KV cache reduced by 93.3%" against DeepSeek 67B: DeepSeek-V2
# (https://huggingface.co/deepseek-ai/DeepSeek-V2/blob/main/config.json: 60 layers, the
# same latent) with its KV cache quantized to 6 bits an element on average, as deployed,
# against DeepSeek LLM 67B (https://huggingface.co/deepseek-ai/deepseek-llm-67b-base:
# 95 layers, 8 KV heads of 128) in bfloat16.
DEEPSEEK_V2 = dict(num_hidden_layers=60, kv_lora_rank=512, qk_rope_head_dim=64)
DEEPSEEK_LLM_67B = dict(num_hidden_layers=95, num_key_value_heads=8, head_dim=128)
DEPLOYED_KV_BITS = 6
CONTEXT_LENS = (256, 1024, 4096)


def config(**fields) -> types.SimpleNamespace:
    return types.SimpleNamespace(**fields)


def per_head_view(kv_heads: int) -> types.SimpleNamespace:
    """DeepSeek-V2-Lite caching keys and values per KV head instead of the latent: its
    keys are ``qk_nope + qk_rope`` = 192 wide, its values 128; `block_bytes` takes one
    head width for both, so the view's is their mean (the same bytes)."""
    lite = DEEPSEEK_V2_LITE
    width = (lite["qk_nope_head_dim"] + lite["qk_rope_head_dim"] + lite["v_head_dim"]) // 2
    return config(
        num_hidden_layers=lite["num_hidden_layers"], num_key_value_heads=kv_heads, head_dim=width
    )


def memory_rows(budget_gib: float, seq_len: int, dtype: torch.dtype) -> list[dict]:
    """Bytes per token and sequences of ``seq_len`` in ``budget_gib`` for each cache."""
    qwen = config(**QWEN25_14B, head_dim=QWEN25_14B["hidden_size"] // 40)
    caches = {
        "DeepSeek-V2-Lite, latent (MLA)": config(**DEEPSEEK_V2_LITE),
        "DeepSeek-V2-Lite, 16 KV heads (MHA)": per_head_view(16),
        "DeepSeek-V2-Lite, 8 KV heads (GQA)": per_head_view(8),
        "DeepSeek-V2-Lite, 2 KV heads (GQA)": per_head_view(2),
        "Qwen2.5-14B, 8 KV heads (GQA)": qwen,
    }
    latent = block_bytes(caches["DeepSeek-V2-Lite, latent (MLA)"], 1, dtype)
    rows = []
    for name, cfg in caches.items():
        per_token = block_bytes(cfg, 1, dtype)
        rows.append(
            {
                "cache": name,
                "bytes_per_token": per_token,
                "latent_share": latent / per_token,
                "sequences": int(budget_gib * 2**30 // (per_token * seq_len)),
            }
        )
    return rows


# `MLAPagedAttention`'s backends: the ``cuda`` one decodes with Triton's kernels (MLA
# has no CUDA kernel of its own), so ``triton`` names both on a GPU.
DECODE_BACKENDS = ("torch", "cpu", "triton")


def paper_anchor() -> dict:
    """The paper's 93.3% worked out from the configs: bytes per token of DeepSeek-V2's
    latent cache in bfloat16 and at `DEPLOYED_KV_BITS`, of DeepSeek 67B's GQA cache in
    bfloat16, and the reductions."""
    latent = block_bytes(config(**DEEPSEEK_V2), 1, torch.bfloat16)
    deployed = latent * DEPLOYED_KV_BITS / (8 * torch.bfloat16.itemsize)
    gqa = block_bytes(config(**DEEPSEEK_LLM_67B), 1, torch.bfloat16)
    return {
        "deepseek_v2_bytes_per_token": latent,
        "deepseek_v2_deployed_bytes_per_token": deployed,
        "deepseek_67b_bytes_per_token": gqa,
        "reduction_bfloat16": 1 - latent / gqa,
        "reduction_deployed": 1 - deployed / gqa,
    }


def format_anchor(anchor: dict) -> str:
    gqa = anchor["deepseek_67b_bytes_per_token"]
    return "\n".join(
        [
            f"the paper's anchor: DeepSeek-V2 against DeepSeek 67B ({gqa:,} bytes a token, "
            "GQA in bfloat16)",
            f"  latent in bfloat16: {anchor['deepseek_v2_bytes_per_token']:>6,} bytes a token, "
            f"{anchor['reduction_bfloat16']:.1%} smaller",
            f"  latent at {DEPLOYED_KV_BITS} bits:   "
            f"{anchor['deepseek_v2_deployed_bytes_per_token']:>6,.0f} bytes a token, "
            f"{anchor['reduction_deployed']:.1%} smaller (the paper: 93.3%)",
        ]
    )


@torch.no_grad()
def decode_rows(
    batch: int,
    context_lens,
    dtype: torch.dtype,
    block_size: int = 16,
    device: torch.device | str = "cpu",
    backend: str = "cpu",
) -> list[dict]:
    """One DeepSeek-V2-Lite layer's decode step, absorbed and unabsorbed, on one of
    `DECODE_BACKENDS` (``cpu``: the C++ kernels; ``triton`` on a GPU): its time and the
    bytes its attention kernel reads, at each of ``context_lens``; the absorbed rows
    carry their ``speedup``."""
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"backend must be one of {DECODE_BACKENDS}, got {backend!r}")
    device = torch.device(device)
    lite = DEEPSEEK_V2_LITE
    heads, rank, rope = lite["num_attention_heads"], lite["kv_lora_rank"], lite["qk_rope_head_dim"]
    nope, v_dim = lite["qk_nope_head_dim"], lite["v_head_dim"]
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    kv_b_proj = torch.nn.Linear(rank, heads * (nope + v_dim), bias=False, device=device)
    kv_b_proj.weight.copy_(randn(*kv_b_proj.weight.shape) / rank**0.5)
    kv_b_proj.to(dtype)
    scale = (nope + rope) ** -0.5
    rows = []
    for length in context_lens:
        per_seq = -(-length // block_size)
        blocks = torch.randperm(batch * per_seq, generator=g, device=device).view(batch, per_seq)
        cache = randn(batch * per_seq, block_size, rank + rope)
        slots = [int(t[-1]) * block_size + (length - 1) % block_size for t in blocks]
        attn = AttentionMetadata.build(
            blocks.tolist(),
            [length - 1] * batch,
            [1] * batch,
            block_size,
            device,
            slot_mapping=slots,
        )
        q_nope, q_pe = randn(batch, heads, nope), randn(batch, heads, rope)
        new = cache.view(-1, rank + rope)[torch.tensor(slots, device=device)].clone()
        steps = {
            form: functools.partial(
                MLAPagedAttention(scale, backend, nope, v_dim, absorb=form == "absorbed"),
                q_nope,
                q_pe,
                new,
                (cache,),
                attn,
                kv_b_proj,
            )
            for form in ("absorbed", "unabsorbed")
        }
        assert_close(steps["absorbed"](), steps["unabsorbed"](), dtype)
        for form, step in steps.items():
            # What the attention kernel reads a step: the latents once, or every
            # head's (zero-padded) keys and values, which decompression wrote first.
            width = rank + rope if form == "absorbed" else 2 * heads * (nope + rope)
            rows.append(
                {
                    "form": form,
                    "backend": backend,
                    "context_len": length,
                    "batch": batch,
                    "dtype": str(dtype).removeprefix("torch."),
                    "kernel_bytes": batch * length * width * dtype.itemsize,
                    "us_per_step": time_us(step, device),
                }
            )
    for absorbed, unabsorbed in zip(rows[::2], rows[1::2]):
        absorbed["speedup"] = unabsorbed["us_per_step"] / absorbed["us_per_step"]
    return rows


MEMORY_COLUMNS = [
    Column("KV cache", "cache"),
    Column("bytes/token", "bytes_per_token", "{:,}"),
    Column("latent / this", "latent_share", "{:.1%}"),
    Column("sequences in budget", "sequences", "{:,}"),
]
DECODE_COLUMNS = [
    Column("decode", "form"),
    Column("context", "context_len"),
    Column("kernel MB read", lambda r: r["kernel_bytes"] / 1e6, "{:.1f}"),
    Column("us/step", "us_per_step", "{:.0f}"),
    Column("absorbed speedup", lambda r: r.get("speedup"), "{:.1f}x"),
]


def plot(memory: list[dict], decode: list[dict]) -> Figure:
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    names = [r["cache"].replace(", ", "\n") for r in memory]
    left.barh(names, [r["bytes_per_token"] / 1024 for r in memory], color="tab:blue")
    left.set_xlabel("KV cache KiB per token")
    left.invert_yaxis()
    draw_decode(right, decode, "one DeepSeek-V2-Lite layer, CPU")
    fig.tight_layout()
    return fig


def draw_decode(ax, decode: list[dict], title: str) -> None:
    """``decode_rows``' time per step against the context length on ``ax``: a line per
    form (absorbed solid, unabsorbed dashed) and backend, one batch size at a time."""
    styles = {"absorbed": "o-", "unabsorbed": "s--"}
    colors = dict(zip(DECODE_BACKENDS, ("tab:blue", "tab:green", "tab:purple")))
    for key in dict.fromkeys((r["backend"], r["batch"], r["form"]) for r in decode):
        rows = [r for r in decode if (r["backend"], r["batch"], r["form"]) == key]
        backend, batch, form = key
        ax.plot(
            [r["context_len"] for r in rows],
            [r["us_per_step"] / 1e3 for r in rows],
            styles[form],
            color=colors[backend],
            label=f"{form}, {backend}, batch {batch}",
        )
    ax.set(xscale="log", yscale="log", xlabel="context length", ylabel="ms per decode step")
    ax.legend(fontsize="small")
    ax.set_title(title)


def add_arguments(parser) -> None:
    parser.add_argument("--budget-gib", type=float, default=16.0, help="(default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=4096, help="(default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="decode batch (default: %(default)s)")
    parser.add_argument(
        "--context-lens", type=int, nargs="+", default=list(CONTEXT_LENS), metavar="N"
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=1,
        help="torch's threads for the decode timings: where other processes share the "
        "cores, more threads wait for each other (default: %(default)s)",
    )
    add_output_flags(parser, NAME)


def main(args) -> None:
    for name in ("budget_gib", "seq_len", "batch"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    memory = memory_rows(args.budget_gib, args.seq_len, torch.bfloat16)
    print(f"KV cache in bfloat16; sequences of {args.seq_len} tokens in {args.budget_gib} GiB")
    print(common.format_table(memory, MEMORY_COLUMNS))
    anchor = paper_anchor()
    print(format_anchor(anchor))
    with common.cpu_threads("cpu", common.check_num_threads(args.num_threads)):
        decode = decode_rows(args.batch, args.context_lens, torch.float32)
    print(
        f"\none DeepSeek-V2-Lite attention layer, float32, batch {args.batch}, CPU kernel, "
        f"{args.num_threads} thread(s)"
    )
    print(common.format_table(decode, DECODE_COLUMNS))
    write(
        args,
        NAME,
        "cpu",
        memory + decode,
        plot(memory, decode),
        budget_gib=args.budget_gib,
        seq_len=args.seq_len,
        num_threads=args.num_threads,
        paper_anchor=anchor,
    )
