"""Perplexity of one INT4 configuration of ``minipaged quantize`` on SmolLM2, measured as
docs/performance.md's calibration studies measure it: Hugging Face's float32 model
holding the dequantized weights, on ``bench quant``'s perplexity windows (its text,
eight windows of 256 tokens), against the unquantized model's.

    python scripts/quant_quality.py gptq --group-size 128 --desc-act --mse \\
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

from minipaged.bench.quant import eval_text, hf_perplexity
from minipaged.models.hub import resolve_model
from minipaged.models.quantization.quantize import (
    METHODS,
    _quantize_layers,
    calibration_samples,
    min_zero_point,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=("none", *METHODS))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--mse", action="store_true")
    parser.add_argument("--true-sequential", action="store_true")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--append", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_start, start = os.getloadavg(), time.perf_counter()
    path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    sym = args.sym and args.method != "awq"
    if args.method != "none":
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
        )
    row = {
        "method": args.method,
        "group_size": args.group_size,
        "sym": sym,
        "desc_act": args.desc_act,
        "mse": args.mse,
        "true_sequential": args.true_sequential,
        # The least zero point its grids took (rows without it predate the rule).
        "min_zero_point": None if sym or args.method == "none" else min_zero_point(args.method),
        "num_samples": args.num_samples,
        "seq_len": args.seq_len,
        "perplexity": hf_perplexity(model, tokenizer, eval_text(), 256, 8),
        "seconds": time.perf_counter() - start,
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
    }
    print(json.dumps(row))
    with open(args.append, "a+") as f:  # runs may finish at once: one writer at a time
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        rows = json.loads(f.read() or "[]")
        f.seek(0), f.truncate()
        f.write(json.dumps([*rows, row], indent=1) + "\n")


if __name__ == "__main__":
    main()
