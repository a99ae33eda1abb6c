"""Perplexity of one INT4 configuration of ``minipaged quantize`` on SmolLM2, measured as
docs/performance.md's calibration studies measure it: Hugging Face's float32 model
holding the dequantized weights, on ``bench quant``'s perplexity windows (its text,
eight windows of 256 tokens), against the unquantized model's.

    python scripts/quant_quality.py gptq --group-size 128 --desc-act --mse \\
        --append benchmarks/results/cpu/quant-quality.json

``--format awq`` keeps the zero points AWQ's format can store (0 and up) instead of
GPTQ's (1 and up: `min_zero_point`).  ``fp8`` rounds the projections to E4M3 with
one scale per output row (the engine's) or, ``--fp8-scale tensor``, per vLLM merged
weight (vLLM's online ``fp8``).  With ``--engine DTYPE`` it measures instead a
checkpoint that ``minipaged quantize`` wrote (``--checkpoint OUT``; methods ``none``,
``fp8`` and ``int8``: the unquantized model, as it is or quantized online) through
minipaged's engine in ``DTYPE``, on the same windows (``--num-samples`` and
``--seq-len`` then say what the checkpoint was calibrated on, as recorded):

    python scripts/quant_quality.py awq-gptq --engine float32 --checkpoint OUT \\
        --append benchmarks/results/cpu/quant-quality.json

Each run appends one row (the configuration, its perplexity, the seconds it took and
the load average) to the ``--append`` file, so runs can go one at a time on a shared
machine; lesson 18 prints the committed file.  Nothing here is tuned on the perplexity
text: every option is its tool's standard setting.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minipaged.bench.common import one_cpu_thread
from minipaged.bench.quant import eval_text, hf_perplexity, perplexity
from minipaged.models.hub import resolve_model
from minipaged.models.quantization.linear import quantize_fp8
from minipaged.models.quantization.quantize import (
    FORMATS,
    METHODS,
    _quantize_layers,
    calibration_samples,
    default_format,
    min_zero_point,
)

WINDOW, WINDOWS = 256, 8  # bench quant's
ONLINE = ("fp8", "int8")  # the engine's online schemes (`quantization=`)
# vLLM's merged projections: its online fp8 takes one scale for each merged weight.
MERGED = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def round_fp8(model, scale: str) -> None:
    """Every projection rounded to E4M3 and back, in place: one scale per output row
    (``scale="channel"``, minipaged's `quantize_fp8`) or per vLLM merged weight
    (``"tensor"``: vLLM's online ``fp8``, ``scaled_fp8_quant(weight, scale=None)``)."""
    for layer in model.model.layers:
        for names in MERGED:
            linears = [getattr(layer.self_attn, n, None) or getattr(layer.mlp, n) for n in names]
            amax = max(float(linear.weight.abs().max()) for linear in linears)
            for linear in linears:
                w = linear.weight.data
                if scale == "channel":
                    fp8, scales = quantize_fp8(w)
                else:
                    scales = torch.tensor(amax / torch.finfo(torch.float8_e4m3fn).max)
                    fp8 = (w / scales).clamp(-448, 448).to(torch.float8_e4m3fn)
                w.copy_(fp8.float() * scales)


def hf_row(args) -> dict:
    """The configuration quantized in memory, Hugging Face's float32 model on it."""
    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    sym = args.sym and args.method != "awq"
    fmt = args.format or default_format(args.method)
    if args.method == "fp8":
        round_fp8(model, args.fp8_scale)
    elif args.method != "none":
        samples = calibration_samples(tokenizer, args.num_samples, args.seq_len)
        _quantize_layers(
            model,
            samples,
            args.method,
            4,
            args.group_size,
            sym,
            args.desc_act,
            mse=args.mse,
            true_sequential=args.true_sequential,
            checkpoint_format=fmt,
        )
    if args.method == "fp8":
        return {
            "method": "fp8",
            "fp8_scale": args.fp8_scale,
            "perplexity": hf_perplexity(model, tokenizer, eval_text(), WINDOW, WINDOWS),
        }
    return {
        "method": args.method,
        "group_size": args.group_size,
        "sym": sym,
        "desc_act": args.desc_act,
        "mse": args.mse,
        "true_sequential": args.true_sequential,
        # The least zero point its grids took (rows without it predate the rule).
        "min_zero_point": None if sym or args.method == "none" else min_zero_point(fmt),
        "format": None if args.method == "none" else fmt,
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "perplexity": hf_perplexity(model, tokenizer, eval_text(), WINDOW, WINDOWS),
    }


def engine_row(args) -> dict:
    """``--checkpoint`` (or the unquantized model) through minipaged's engine."""
    from minipaged.llm import LLM

    path = args.checkpoint or resolve_model(args.model)
    config = json.loads((path / "config.json").read_text()).get("quantization_config", {})
    found = config.get("minipaged_method", config.get("quant_method", "none"))
    if found != (args.method if args.method not in ONLINE else "none"):
        raise ValueError(f"{path} is not a {args.method!r} checkpoint: {config}")
    online = args.method if args.method in ONLINE else None
    with one_cpu_thread("cpu"):
        llm = LLM(str(path), device="cpu", dtype=args.engine, swap_space=0, quantization=online)
        value = perplexity(llm, eval_text(), WINDOW, WINDOWS)
    calibration = {"num_samples": args.num_samples, "seq_len": args.seq_len}
    return {
        "method": args.method,
        "engine_dtype": args.engine,
        "checkpoint": str(path),
        "quantization_config": config or None,
        # As given: the checkpoint does not record its calibration.
        **(calibration if config else {}),
        "perplexity": value,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=("none", *METHODS, *ONLINE))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--mse", action="store_true")
    parser.add_argument("--true-sequential", action="store_true")
    parser.add_argument("--format", choices=FORMATS, help="whose zero points (default: gptq's)")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--engine", choices=("float32", "bfloat16"), help="minipaged's engine")
    parser.add_argument("--checkpoint", type=Path, help="with --engine: what quantize wrote")
    parser.add_argument("--fp8-scale", choices=("channel", "tensor"), default="channel")
    parser.add_argument("--append", type=Path, required=True)
    args = parser.parse_args()
    if args.method == "int8" and not args.engine:
        parser.error("int8 is measured through the engine (--engine)")
    if args.engine and args.method not in ("none", *ONLINE) and args.checkpoint is None:
        parser.error("--engine measures a --checkpoint (or method none)")
    torch.set_num_threads(1)
    load_start, start = os.getloadavg(), time.perf_counter()
    row = engine_row(args) if args.engine else hf_row(args)
    row.update(
        seconds=time.perf_counter() - start,
        load_average_start=list(load_start),
        load_average_end=list(os.getloadavg()),
    )
    print(json.dumps(row))
    with open(args.append, "a+") as f:  # runs may finish at once: one writer at a time
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        rows = json.loads(f.read() or "[]")
        f.seek(0), f.truncate()
        f.write(json.dumps([*rows, row], indent=1) + "\n")


if __name__ == "__main__":
    main()
