"""``minipaged bench quant``: quantized weights against the unquantized model, in memory,
quality and decode speed (`minipaged.models.quantization`).

For each scheme, on SmolLM2 by default: ``none`` (unquantized, in ``--dtype``),
``fp32`` (unquantized in float32 whatever ``--dtype`` says: the baseline of the
speed goal "int8 weight-only 1.5x faster than float32 at batch 1"), ``int8`` and
``fp8`` online, and the INT4 checkpoints that ``minipaged quantize`` writes with
``rtn``, ``gptq`` and ``awq`` (written once into ``--workdir`` and reused):

- **weight bytes**: the model's weights as they run (`weight_bytes`), and the ratio to
  the unquantized model's; the embedding, norms and LM head stay in the model's dtype
  in every scheme, so the ratio of the projections alone is given too;
- **perplexity** on a fixed text (`eval_text`: standard-library docstrings other than
  the calibration's), from the engine's prompt logprobs over windows of ``--window``
  tokens: ``exp(-mean log p)``;
- **multiple-choice accuracy**: the 50 questions of the lm-eval test's local task,
  scored by lm-evaluation-harness's rule for ``multiple_choice`` in process
  (`minipaged.bench.kv_quality.mc_answers`; ``tests/test_lm_eval.py`` shows the same
  rule through ``minipaged serve`` and ``lm_eval`` giving lm-eval's own answers), and
  how many answers differ from the unquantized model's;
- **decode tokens/s** at batch 1, 8 and 32: a full batch decoding, each engine's step
  timed in turn with the others' (a busy machine slows all alike), tokens per second
  from the median step, and the ratio to the unquantized model's at the same batch
  (and to the float32 model's, where ``fp32`` is among the schemes).

On a CPU torch runs on one thread (`bench.common.one_cpu_thread`), in bfloat16 by
default: torch's packed weight-only CPU ops (`minipaged.ops.quant_linear`) are
vectorized for bfloat16 and float16 activations, and in torch 2.13 run a scalar loop for
float32 ones, tens of times slower than oneDNN's float32 matmul.

With ``--peer vllm-cpu``, vLLM's CPU build then runs each scheme it can load on the same
checkpoints, dtype, prompts and one thread (`minipaged.bench.vllm_quant`, whose docstring
says how its rate is timed: both are decode tokens/s of a full batch), and each row gets
its rate, its ratio to its own unquantized model's, minipaged's rate over its rate, and
the largest gap between its first-token logprobs and minipaged's.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from pathlib import Path

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from minipaged.arg_utils import add_model_flag
from minipaged.bench import common, vllm_quant
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column, one_cpu_thread
from minipaged.bench.kv_quality import mc_answers, mc_questions
from minipaged.bench.vllm_peer import SYSTEM as VLLM_CPU
from minipaged.bench.vllm_peer import PeerUnavailableError, peer_env, peer_python
from minipaged.bench.vllm_quant import LOGPROB_PROMPTS, NUM_LOGPROBS, decode_prompts
from minipaged.llm import LLM
from minipaged.models.hub import resolve_model
from minipaged.models.loader import read_config
from minipaged.models.quantization import weight_bytes
from minipaged.models.quantization.quantize import docstrings, quantize_checkpoint
from minipaged.sampling_params import SamplingParams

NAME = "quant"
HELP = "quantized weights (int8, fp8, int4 rtn/gptq/awq): bytes, perplexity, decode tokens/s"
DESCRIPTION = (
    "Load the model unquantized, with int8 and fp8 online, and as INT4 checkpoints written "
    "by minipaged quantize (rtn, gptq, awq); measure each one's weight bytes, perplexity on "
    "a fixed text and decode tokens/s at batch 1, 8 and 32."
)
SCHEMES = ("none", "fp32", "int8", "fp8", "rtn", "gptq", "awq")
INT4_METHODS = ("rtn", "gptq", "awq")
EVAL_MODULES = ("pathlib", "textwrap", "functools", "dataclasses", "shutil", "tarfile")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def eval_text() -> str:
    """The fixed text perplexity is measured on (none of it in the calibration text)."""
    return docstrings(EVAL_MODULES)


def awq_group_size(config, wanted: int) -> int:
    """The largest group size up to ``wanted`` that divides every projection's inputs
    (AWQ's groups must: SmolLM2's 576 columns take 64, not 128)."""
    inputs = (config.hidden_size, config.intermediate_size)
    return next(g for g in (128, 64, 32) if g <= wanted and all(k % g == 0 for k in inputs))


def checkpoint(
    model: Path, method: str, group_size: int, workdir: Path, desc_act: bool = True
) -> Path:
    """``model`` quantized with ``method``, written once into ``workdir``; GPTQ with
    act-order (``desc_act``, AutoGPTQ's default) unless ``desc_act`` is False: on SmolLM2
    it took perplexity from 1.25x to 1.12x the unquantized model's, and vllm-cpu 0.32
    refuses it ("desc_act=True is no longer supported")."""
    act_order = method == "gptq" and desc_act
    out = workdir / f"{model.name}-{method}-g{group_size}{'-desc-act' if act_order else ''}"
    if not (out / "model.safetensors").is_file():
        quantize_checkpoint(model, out, method=method, group_size=group_size, act_order=act_order)
    return out


def engine_args(
    model: Path, scheme: str, group_size: int, workdir: Path, desc_act: bool = True
) -> dict:
    if scheme in INT4_METHODS:
        if scheme == "awq":
            group_size = awq_group_size(read_config(model), group_size)
        return {"model": str(checkpoint(model, scheme, group_size, workdir, desc_act))}
    if scheme == "fp32":
        return {"model": str(model), "quantization": None, "dtype": "float32"}
    return {"model": str(model), "quantization": None if scheme == "none" else scheme}


def perplexity_windows(tokenizer, text: str, window: int, max_windows: int) -> list[list[int]]:
    """The first ``max_windows`` windows of ``window`` tokens of ``text``."""
    ids = tokenizer(text)["input_ids"]
    windows = [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]
    return windows[:max_windows]


def perplexity(llm: LLM, text: str, window: int, max_windows: int) -> float:
    """``exp(-mean log p)`` of ``text``'s tokens, in windows of ``window`` tokens."""
    windows = perplexity_windows(llm.get_tokenizer(), text, window, max_windows)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    logprobs = [
        entry[token]
        for out in outputs
        for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])
    ]
    return math.exp(-sum(logprobs) / len(logprobs))


@torch.no_grad()
def hf_perplexity(model, tokenizer, text: str, window: int, max_windows: int) -> float:
    """`perplexity` of a Hugging Face model on the same windows (the calibration
    studies' measure: its float32 model holding the dequantized weights)."""
    ids = torch.tensor(perplexity_windows(tokenizer, text, window, max_windows))
    logits = model(ids, use_cache=False).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])
    return math.exp(-float(logprobs.mean()))


def projection_bytes(model) -> int:
    """The quantized projections' bytes (`weight_bytes` less everything else)."""
    others = sum(
        t.nbytes
        for n, t in (*model.named_parameters(), *model.named_buffers())
        if n.rsplit(".", 2)[-2] not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    )
    return weight_bytes(model) - others


def decode_rates(engines: dict, batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    """Each engine's decode tokens/s at ``batch``, the engines' steps taken in turn."""
    prompts = decode_prompts(next(iter(engines.values())).vocab_size, batch, prompt_len)
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    for engine in engines.values():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{batch}-{i}", prompt, params)
        engine.step()  # the prefills: every step from here on decodes
    times = {name: [] for name in engines}
    for _ in tqdm(range(steps), desc=f"batch {batch}", leave=False):
        for name, engine in engines.items():
            times[name].append(common.timed(engine.step, torch.device("cpu"))[1])
    for engine in engines.values():
        while engine.has_unfinished_requests():
            engine.step()
    return {name: batch / statistics.median(t) for name, t in times.items()}


def first_token_logprobs(llm: LLM, prompts: list[list[int]]) -> list[dict[int, float]]:
    """The first (greedy) token's top logprobs of each prompt: the peer's cross-check."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=NUM_LOGPROBS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [dict(o.outputs[0].logprobs[0]) for o in outputs]


def bench_quant(
    model: Path,
    workdir: Path,
    schemes=SCHEMES,
    batches=(1, 8, 32),
    steps: int = 12,
    prompt_len: int = 32,
    group_size: int = 128,
    dtype: str = "bfloat16",
    window: int = 256,
    max_windows: int = 8,
    mc_count: int | None = None,
    logprob_prompts: list[list[int]] = (),
    desc_act: bool = True,
) -> list[dict]:
    """One row per scheme: bytes, perplexity, decode tokens/s per batch (module docstring),
    and the first token's top logprobs for each of ``logprob_prompts``."""
    text, questions = eval_text(), mc_questions(count=mc_count)
    engines, rows, answers = {}, [], {}
    with one_cpu_thread("cpu"):
        for scheme in tqdm(schemes, desc="schemes", leave=False):
            args = engine_args(model, scheme, group_size, workdir, desc_act)
            args.setdefault("dtype", dtype)
            llm = LLM(
                args.pop("model"), device="cpu", max_num_seqs=max(batches), swap_space=0, **args
            )
            engine = engines[scheme] = llm.engine
            rows.append(
                {
                    "scheme": scheme,
                    "weight_bytes": weight_bytes(engine.model),
                    "projection_bytes": projection_bytes(engine.model),
                    "perplexity": perplexity(llm, text, window, max_windows),
                    "first_token_logprobs": first_token_logprobs(llm, list(logprob_prompts)),
                }
            )
            answers[scheme] = mc_answers(llm, questions)
            rows[-1]["mc_accuracy"] = sum(
                a == q["answer"] for a, q in zip(answers[scheme], questions)
            ) / len(questions)
            rows[-1]["mc_answers_changed"] = sum(
                a != b for a, b in zip(answers[scheme], answers[schemes[0]])
            )
        for batch in batches:
            rates = decode_rates(engines, batch, steps, prompt_len)
            for row in rows:
                row[f"decode_tokens_per_s_b{batch}"] = rates[row["scheme"]]
    base = rows[0]
    for row in rows:
        row["bytes_vs_none"] = row["weight_bytes"] / base["weight_bytes"]
        row["projection_bytes_vs_none"] = row["projection_bytes"] / base["projection_bytes"]
        row["perplexity_vs_none"] = row["perplexity"] / base["perplexity"]
        for batch in batches:
            key = f"decode_tokens_per_s_b{batch}"
            row[f"speed_vs_none_b{batch}"] = row[key] / base[key]
    fp32 = next((r for r in rows if r["scheme"] == "fp32"), None)
    for row in rows if fp32 else ():
        for batch in batches:
            key = f"decode_tokens_per_s_b{batch}"
            row[f"speed_vs_fp32_b{batch}"] = row[key] / fp32[key]
    return rows


def format_table(rows: list[dict], batches) -> str:
    columns = [
        Column("scheme", "scheme"),
        Column("weights (MB)", lambda r: r["weight_bytes"] / 1e6, "{:.1f}"),
        Column("x none", "bytes_vs_none", "{:.3f}"),
        Column("projections x none", "projection_bytes_vs_none", "{:.3f}"),
        Column("perplexity", "perplexity", "{:.3f}"),
        Column("ppl x none", "perplexity_vs_none", "{:.4f}"),
        Column("MC acc", "mc_accuracy", "{:.2f}"),
        Column("MC changed", "mc_answers_changed"),
    ]
    for b in batches:
        columns.append(Column(f"tok/s b{b}", f"decode_tokens_per_s_b{b}", "{:.1f}"))
        columns.append(Column(f"x none b{b}", f"speed_vs_none_b{b}", "{:.2f}"))
        if f"speed_vs_fp32_b{b}" in rows[0]:
            columns.append(Column(f"x fp32 b{b}", f"speed_vs_fp32_b{b}", "{:.2f}"))
    return common.format_table(rows, columns)


def plot_quant(rows: list[dict], batches, title: str) -> Figure:
    """Bytes, perplexity and decode speed per scheme, each against the unquantized model."""
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    mem_ax, ppl_ax, speed_ax = fig.subplots(1, 3)
    names = [r["scheme"] for r in rows]
    bars = mem_ax.bar(names, [r["projection_bytes_vs_none"] for r in rows])
    mem_ax.bar_label(bars, [f"{r['projection_bytes_vs_none']:.3f}" for r in rows], fontsize=7)
    mem_ax.set_ylabel("projections' bytes / unquantized")
    bars = ppl_ax.bar(names, [r["perplexity"] for r in rows])
    ppl_ax.bar_label(bars, [f"{r['perplexity']:.2f}" for r in rows], fontsize=7)
    ppl_ax.set_ylabel("perplexity (fixed text)")
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        xs = [j + i * width for j in range(len(rows))]
        speed_ax.bar(xs, [r[f"speed_vs_none_b{b}"] for r in rows], width, label=f"batch {b}")
    speed_ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], names)
    speed_ax.axhline(1, color="#555555", linewidth=0.8)
    speed_ax.set_ylabel("decode tokens/s / unquantized")
    speed_ax.legend(fontsize=7)
    fig.suptitle(title)
    return fig


# -- the command ----------------------------------------------------------------------
def add_arguments(parser) -> None:
    add_model_flag(parser, "smollm2", default="smollm2")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    for flag, default, help_ in (
        ("--steps", 12, "decode steps timed per engine and batch"),
        ("--prompt-len", 32, "tokens per prompt of the decode batches"),
        ("--group-size", 128, "INT4 group size (AWQ's: the largest up to it that divides)"),
        ("--window", 256, "tokens per perplexity window"),
        ("--max-windows", 8, "perplexity windows"),
        ("--mc-questions", 50, "multiple-choice questions (of 50)"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{help_} (default: %(default)s)")
    parser.add_argument(
        "--dtype", default="bfloat16", help="the model's dtype (default: %(default)s)"
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path.home() / ".cache" / "minipaged" / "quantized",
        help="where the INT4 checkpoints are written once (default: %(default)s)",
    )
    parser.add_argument(
        "--desc-act",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the gptq checkpoint with GPTQ's act-order, which vllm-cpu 0.32 does not "
        "load (default: %(default)s)",
    )
    parser.add_argument(
        "--peer",
        choices=[VLLM_CPU],
        help="also run vLLM's CPU build (make peer-vllm) on each scheme it loads, on one "
        "thread in --dtype: its decode tokens/s beside minipaged's, and its first-token "
        "logprobs against minipaged's (`minipaged.bench.vllm_quant`)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="the peer's timed generate pairs per batch, the median reported "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="the peer runs eagerly, as minipaged does on a CPU (default: it compiles, as "
        "its CPU build chooses; minutes at start on a busy machine)",
    )
    add_output_flags(parser, NAME)


def run_peer(model: Path, rows: list[dict], args, logprob_prompts) -> None:
    """The peer's fields in ``rows`` (`vllm_quant.add_peer`) on the same checkpoints,
    dtypes and prompts as minipaged's, one thread as minipaged's."""
    schemes = {
        r["scheme"]: {"dtype": args.dtype}
        | engine_args(model, r["scheme"], args.group_size, args.workdir, args.desc_act)
        for r in rows
    }
    prompts = decode_prompts(read_config(model).vocab_size, max(args.batches), args.prompt_len)

    def make_workload(path: str, dtype: str) -> vllm_quant.DecodeWorkload:
        return vllm_quant.decode_workload(
            path,
            dtype,
            prompts,
            args.batches,
            args.steps,
            args.repeats,
            logprob_prompts,
            args.enforce_eager,
        )

    vllm_quant.add_peer(rows, schemes, args.batches, make_workload)


def main(args) -> None:
    if args.schemes[0] != "none":
        raise ValueError("--schemes must start with none, the baseline of every ratio")
    if args.peer:
        try:
            peer_python()  # before the minutes of minipaged's part
        except PeerUnavailableError as error:
            raise ValueError(f"--peer {args.peer}: {error}") from error
    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    logprob_prompts = [tokenizer(text)["input_ids"] for text in LOGPROB_PROMPTS]
    load_start = list(os.getloadavg())  # a shared machine's load slows every rate
    rows = bench_quant(
        model,
        args.workdir,
        tuple(args.schemes),
        tuple(args.batches),
        args.steps,
        args.prompt_len,
        args.group_size,
        args.dtype,
        args.window,
        args.max_windows,
        args.mc_questions,
        logprob_prompts,
        args.desc_act,
    )
    print(format_table(rows, args.batches))
    if args.peer:
        run_peer(model, rows, args, logprob_prompts)
        print(vllm_quant.format_table(rows, args.batches))
    title = f"{model.name} ({args.dtype}) on a CPU, one thread: quantized weights"
    write(
        args,
        NAME,
        "cpu",
        rows,
        plot_quant(rows, args.batches, title),
        model=str(model),
        dtype=args.dtype,
        group_size=args.group_size,
        desc_act=args.desc_act,
        load_average_start=load_start,
        load_average_end=list(os.getloadavg()),
        **(
            {"peer": args.peer, "peer_env": peer_env(1), "peer_repeats": args.repeats}
            if args.peer
            else {}
        ),
    )
