"""``minipaged bench embed``: a pooling model's requests/s, minipaged's engine against
Hugging Face's batched forward on the same CPU.

The same prompts (seeded random lengths, byte tokens) go through ``LLM.embed``
(``runner="pooling"``: each prompt one prefill, chunked past ``max_num_batched_tokens``,
batched with the others by the scheduler, its hidden states pooled as it runs,
`minipaged.models.pooler`) and through transformers' ``AutoModel`` in right-padded
batches, pooled the same way (LAST, MEAN or CLS) and normalized.  The two systems'
embeddings are compared (the largest absolute difference is in the results), and the
ratio of their requests/s is printed and saved with the rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from minipaged.arg_utils import add_engine_flags, engine_kwargs
from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column
from minipaged.pooling_params import POOLING_TYPES

NAME = "embed"
HELP = "embeddings: requests/s of LLM.embed (runner='pooling') against HF batched"
DESCRIPTION = (
    "The same seeded prompts through LLM.embed (runner='pooling': each prompt one "
    "prefill, chunked and batched by the scheduler, pooled as it runs) and through "
    "transformers' AutoModel in right-padded batches, pooled the same way; requests/s, "
    "their ratio, and the largest difference between the two systems' embeddings."
)


def prompts(count: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list]:
    """``count`` prompts of seeded random lengths in ``[min_len, max_len]``, random ids."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    high = min(vocab_size, 256)
    return [torch.randint(0, high, (n,), generator=generator).tolist() for n in lengths]


def hf_embed(model, batch: list[list[int]], pooling_type: str) -> torch.Tensor:
    """One right-padded forward of ``batch``, pooled over each prompt's own tokens."""
    width = max(map(len, batch))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
    with torch.inference_mode():
        hidden = model(ids, attention_mask=mask).last_hidden_state.float()
    if pooling_type == "LAST":
        pooled = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
    elif pooling_type == "MEAN":
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    else:
        pooled = hidden[:, 0]
    return F.normalize(pooled, dim=-1)


def run_hf(path, requests: list[list[int]], batch_size: int, pooling_type: str):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    hf_embed(model, requests[:2], pooling_type)  # warm-up

    def run():
        return torch.cat(
            [
                hf_embed(model, requests[i : i + batch_size], pooling_type)
                for i in range(0, len(requests), batch_size)
            ]
        )

    return common.timed(run, torch.device("cpu"))


def run_minipaged(path, requests: list[list[int]], kwargs: dict):
    from minipaged.llm import LLM

    llm = LLM(path, **{**kwargs, "runner": "pooling", "device": "cpu", "dtype": "float32"})
    inputs = [{"prompt_token_ids": p} for p in requests]
    llm.embed(inputs[:2], use_tqdm=False)  # warm-up
    outputs, seconds = common.timed(lambda: llm.embed(inputs, use_tqdm=False), torch.device("cpu"))
    return torch.tensor([o.outputs.embedding for o in outputs]), seconds


COLUMNS = [
    Column("system", "system"),
    Column("requests/s", "requests_per_s", "{:.2f}"),
    Column("prompt tokens/s", "tokens_per_s", "{:.0f}"),
    Column("vs HF", "vs_hf", "{:.2f}x"),
]


def plot(rows: list[dict], pooling_type: str) -> Figure:
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.bar([r["system"] for r in rows], [r["requests_per_s"] for r in rows], color="tab:blue")
    ax.set(ylabel="requests/s", title=f"embeddings ({pooling_type}), CPU")
    fig.tight_layout()
    return fig


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="smollm2", help="(default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--min-len", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--max-len", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument(
        "--hf-batch-size", type=int, default=16, help="HF's batch (default: %(default)s)"
    )
    parser.add_argument(
        "--pooling-type", choices=POOLING_TYPES, default="LAST", help="(default: %(default)s)"
    )
    parser.add_argument("--num-threads", type=int, default=1, help="(default: %(default)s)")
    add_engine_flags(parser, exclude=("runner", "task", "pooler_config", "device", "dtype"))
    add_output_flags(parser, NAME)


def main(args) -> None:
    from minipaged.models.hub import resolve_model
    from minipaged.models.loader import read_config

    for name in ("num_requests", "min_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_len < args.min_len:
        raise ValueError("--max-len must be >= --min-len")
    path = resolve_model(args.model)
    vocab = read_config(path).vocab_size
    requests = prompts(args.num_requests, args.min_len, args.max_len, vocab, seed=0)
    kwargs = {**engine_kwargs(args), "pooler_config": {"pooling_type": args.pooling_type}}
    with common.cpu_threads("cpu", common.check_num_threads(args.num_threads)):
        ours, our_s = run_minipaged(path, requests, kwargs)
        theirs, hf_s = run_hf(path, requests, args.hf_batch_size, args.pooling_type)
    tokens = sum(map(len, requests))
    rows = [
        {"system": system, "seconds": s, "requests_per_s": len(requests) / s}
        for system, s in (("minipaged", our_s), (f"hf-batched-{args.hf_batch_size}", hf_s))
    ]
    for row in rows:
        row["tokens_per_s"] = tokens / row["seconds"]
        row["vs_hf"] = hf_s / row["seconds"]
    max_diff = float((ours - theirs).abs().max())
    print(
        f"{len(requests)} prompts of {args.min_len}-{args.max_len} tokens ({tokens} in all), "
        f"{args.pooling_type} pooling; largest |minipaged - HF| = {max_diff:.2e}"
    )
    print(common.format_table(rows, COLUMNS))
    write(
        args,
        NAME,
        torch.device("cpu"),
        rows,
        plot(rows, args.pooling_type),
        model=args.model,
        pooling_type=args.pooling_type,
        num_requests=args.num_requests,
        max_abs_diff=max_diff,
        num_threads=args.num_threads,
    )
