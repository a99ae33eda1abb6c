"""``minipaged bench spec``: speculative decoding with the n-gram proposer, on and off.

Two workloads on a real model (SmolLM2-135M-Instruct by default):

- ``repeat``: "rewrite this paragraph with one word changed", the paragraphs taken from
  minipaged's own module docstrings (text shipped with the code).  The answer copies
  its context, which is where prompt lookup guesses right;
- ``sharegpt``: ShareGPT-like lengths over random token ids (`bench.throughput`'s
  synthetic prompts), where the context says little about the answer: low acceptance.

For each workload, batch size (requests submitted together) and ``k`` (0: speculation
off), the same greedy requests run through ``LLM.generate``; the rounds of all ``k``
alternate, and each configuration's time is its median round, so that the machine's
load weighs on all of them alike.  Reported: time per output token, output tokens per
second, the acceptance rate, and the speed-up against ``k = 0`` of the same batch size
(a ratio within one run).  Greedy decoding is lossless, so every ``k`` must produce
exactly the tokens ``k = 0`` did; the benchmark checks it.
"""

from __future__ import annotations

import inspect
import statistics
import time

from matplotlib.figure import Figure

from minipaged.arg_utils import DEFAULT_MODEL, add_model_flag
from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, one_cpu_thread
from minipaged.bench.presets import make_prompts
from minipaged.core.memory.workloads import synthetic_requests
from minipaged.llm import LLM
from minipaged.models.hub import resolve_model
from minipaged.sampling_params import SamplingParams

NAME = "spec"
HELP = "speculative decoding (n-gram) on and off: time per token, throughput, acceptance"
DESCRIPTION = (
    "Greedy requests with n-gram speculative decoding off (k=0) and on (k=2, 4, 8), at "
    "several batch sizes, on a workload whose answer repeats its context and on a "
    "ShareGPT-like one; rounds alternate between the settings."
)
WORKLOADS = ("repeat", "sharegpt")
NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def paragraphs(min_words: int = 40, max_words: int = 90) -> list[str]:
    """Prose paragraphs of minipaged's own module docstrings, in a fixed order."""
    import minipaged.core.memory.block_table
    import minipaged.core.memory.kv_cache_manager
    import minipaged.core.sched.scheduler
    import minipaged.engine.llm_engine
    import minipaged.sequence
    import minipaged.spec_decode.speculator

    modules = [
        minipaged.engine.llm_engine,
        minipaged.core.sched.scheduler,
        minipaged.sequence,
        minipaged.core.memory.block_table,
        minipaged.core.memory.kv_cache_manager,
        minipaged.spec_decode.speculator,
    ]
    found = []
    for module in modules:
        for block in inspect.getdoc(module).split("\n\n"):
            text = " ".join(block.split())
            if min_words <= len(text.split()) <= max_words and not text.startswith(("-", "1.")):
                found.append(text)
    return found


def repeat_prompts(tokenizer, num_requests: int) -> tuple[list[list[int]], list[int]]:
    """Chat prompts asking to rewrite a paragraph with one word changed; each answer
    may take as many tokens as its paragraph."""
    prompts, lengths = [], []
    texts = paragraphs()
    for i in range(num_requests):
        text = texts[i % len(texts)]
        word = max(text.split(), key=len).strip(".,:;()`*")
        message = (
            f"Rewrite this paragraph exactly, changing only the word '{word}' to 'thing':\n\n{text}"
        )
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))  # as LLM.chat
        lengths.append(len(tokenizer.encode(text)) + 8)
    return prompts, lengths


def sharegpt_prompts(tokenizer, vocab_size, num_requests: int, max_len: int, seed: int = 0):
    specs = synthetic_requests("sharegpt", num_requests, seed=seed, max_len=max_len)
    return make_prompts(specs, tokenizer, vocab_size, seed), [s.output_len for s in specs]


def bench_spec(
    model: str = DEFAULT_MODEL,
    workloads=WORKLOADS,
    batch_sizes=(1, 8, 32),
    ks=(0, 2, 4, 8),
    max_tokens: int = 64,
    rounds: int = 3,
    progress: bool = True,
) -> list[dict]:
    """One row per (workload, batch size, k), timed as the module says."""
    from tqdm.auto import tqdm

    for name, value in (("max_tokens", max_tokens), ("rounds", rounds)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not workloads or any(w not in WORKLOADS for w in workloads):
        raise ValueError(f"workloads must be some of {WORKLOADS}, got {list(workloads)}")
    if not ks or 0 not in ks or any(not isinstance(k, int) or k < 0 for k in ks):
        raise ValueError(f"ks must be ints >= 0 and include 0 (the baseline), got {list(ks)}")
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be ints >= 1, got {list(batch_sizes)}")
    path = resolve_model(model)
    llms = {
        k: LLM(
            str(path),
            device="cpu",
            swap_space=0,
            max_num_seqs=max(batch_sizes),
            speculative_config={**NGRAM, "num_speculative_tokens": k} if k else None,
        )
        for k in ks
    }
    tokenizer = llms[0].get_tokenizer()
    rows = []
    settings = [(w, b) for w in workloads for b in batch_sizes]
    bar = tqdm(total=len(settings) * rounds * len(ks), disable=not progress, desc="bench spec")
    for workload, batch in settings:
        if workload == "repeat":
            prompts, lengths = repeat_prompts(tokenizer, batch)
        else:
            prompts, lengths = sharegpt_prompts(tokenizer, llms[0].engine.vocab_size, batch, 512)
        params = [SamplingParams(temperature=0, max_tokens=min(n, max_tokens)) for n in lengths]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        times = {k: [] for k in ks}
        tokens, stats = {}, {}
        for _ in range(rounds):
            for k in ks:  # alternate: the machine's load weighs on every k alike
                before = llms[k].stats()
                start = time.perf_counter()
                outputs = llms[k].generate(inputs, params, use_tqdm=False)
                times[k].append(time.perf_counter() - start)
                tokens[k] = [o.outputs[0].token_ids for o in outputs]
                stats[k] = _delta(before, llms[k].stats())
                bar.update()
        for k in ks:
            if tokens[k] != tokens[0]:
                raise AssertionError(f"k={k} changed the greedy tokens of {workload}")
            rows.append(_row(workload, batch, k, tokens[k], statistics.median(times[k]), stats[k]))
    bar.close()
    for row in rows:
        base = next(
            r
            for r in rows
            if (r["workload"], r["batch"], r["k"]) == (row["workload"], row["batch"], 0)
        )
        row["speedup"] = base["ms_per_output_token"] / row["ms_per_output_token"]
    for llm in llms.values():
        llm.engine.shutdown()
    return rows


def _delta(before: dict, after: dict) -> dict:
    return {
        key: after[key] - before[key]
        for key in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "num_steps")
        if key in after
    }


def _row(workload, batch, k, tokens, elapsed, stats) -> dict:
    output_tokens = sum(map(len, tokens))
    guessed = stats.get("spec_decode_num_draft_tokens", 0)
    return {
        "workload": workload,
        "batch": batch,
        "k": k,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "ms_per_output_token": 1000 * elapsed / output_tokens * batch,
        "output_tokens_per_s": output_tokens / elapsed,
        "steps": stats["num_steps"],
        "acceptance_rate": stats["spec_decode_num_accepted_tokens"] / guessed if guessed else None,
    }


def format_table(rows: list[dict]) -> str:
    return common.format_table(
        rows,
        [
            Column("workload", "workload"),
            Column("batch", "batch"),
            Column("k", "k"),
            Column("ms / token / request", "ms_per_output_token", "{:.1f}"),
            Column("tokens/s", "output_tokens_per_s", "{:.1f}"),
            Column("steps", "steps"),
            Column("acceptance", "acceptance_rate", "{:.0%}"),
            Column("speed-up", "speedup", "{:.2f}x"),
        ],
    )


def plot_spec(rows: list[dict], title: str) -> Figure:
    """Speed-up against k = 0 per batch size, one panel per workload."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig = Figure(figsize=(4.5 * len(workloads), 3.5), layout="constrained")
    axes = fig.subplots(1, len(workloads), squeeze=False)[0]
    for ax, workload in zip(axes, workloads):
        ours = [r for r in rows if r["workload"] == workload]
        for batch in dict.fromkeys(r["batch"] for r in ours):
            line = [r for r in ours if r["batch"] == batch]
            ax.plot(
                [r["k"] for r in line], [r["speedup"] for r in line], "o-", label=f"batch {batch}"
            )
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("k (guesses per step; 0 = off)")
        ax.set_ylabel("speed-up vs k = 0")
        ax.set_title(workload)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, DEFAULT_MODEL, DEFAULT_MODEL)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument(
        "--batch-sizes", nargs="+", type=int, default=[1, 8, 32], metavar="N",
        help="(default: 1 8 32)",
    )  # fmt: skip
    parser.add_argument(
        "--ks", nargs="+", type=int, default=[0, 2, 4, 8], metavar="K",
        help="guesses per step; 0 is the baseline (default: 0 2 4 8)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N")
    parser.add_argument("--rounds", type=int, default=3, metavar="N")
    add_output_flags(parser, NAME)


def main(args) -> None:
    with one_cpu_thread("cpu"):  # threads competing for busy cores make timings erratic
        rows = bench_spec(
            args.model, args.workloads, args.batch_sizes, args.ks, args.max_tokens, args.rounds
        )
    print(format_table(rows))
    title = f"n-gram speculative decoding, {args.model} on a CPU (greedy, lossless)"
    write(
        args,
        NAME,
        "cpu",
        rows,
        plot_spec(rows, title),
        model=args.model,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
    )
