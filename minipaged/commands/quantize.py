"""``minipaged quantize MODEL --method {rtn,gptq,awq,awq-gptq} --bits 4 --group-size 128
OUT``: `minipaged.models.quantization.quantize.quantize_checkpoint`."""

from __future__ import annotations

import argparse
import json

from minipaged.arg_utils import MODEL_HELP

# The quantize module's, without importing it.
METHODS = ("rtn", "gptq", "awq", "awq-gptq")
FORMATS = ("gptq", "awq")

NAME = "quantize"
HELP = "write an INT4 GPTQ or AWQ checkpoint of a model"
DESCRIPTION = (
    "Quantize a 16/32-bit checkpoint's projections to 4 bits, group-wise, by rounding "
    "(rtn), GPTQ, AWQ or AWQ's scales then GPTQ on a small calibration text, and write "
    "it in Hugging Face's GPTQ or AWQ format (--format), which `minipaged generate --model "
    "OUT` and vLLM load."
)


def add_arguments(parser) -> None:
    parser.add_argument("model", help=MODEL_HELP)
    parser.add_argument("out", help="directory to write (created if missing)")
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="gptq",
        help="awq-gptq: AWQ's scales, then GPTQ's rounding",
    )
    parser.add_argument(
        "--format",
        dest="checkpoint_format",
        choices=FORMATS,
        default=None,
        help="the checkpoint's format (default: awq for --method awq, else gptq); awq's "
        "stores zero points of 0, gptq's needs them >= 1 but has act-order's g_idx",
    )
    parser.add_argument("--bits", type=int, default=4, help="bits per weight (4)")
    parser.add_argument(
        "--group-size", type=int, default=128, help="input columns per scale: 32, 64, 128 or -1"
    )
    parser.add_argument(
        "--desc-act", action="store_true", help="GPTQ's act-order: columns by decreasing H_ii"
    )
    parser.add_argument(
        "--sym",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="zero points at the middle (rtn and gptq; awq's are always asymmetric)",
    )
    parser.add_argument(
        "--mse",
        action="store_true",
        help="each group's range by GPTQ's MSE grid search (rtn, gptq, awq-gptq)",
    )
    parser.add_argument(
        "--true-sequential",
        action="store_true",
        help="AutoGPTQ's: q/k/v, then o, gate/up, down, each on the quantized ones' outputs",
    )
    parser.add_argument("--num-samples", type=int, default=64, help="calibration sequences")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the column loop's ops are small)",
    )


def main(args) -> None:
    from minipaged.models.hub import resolve_model
    from minipaged.models.quantization.quantize import quantize_checkpoint

    out = quantize_checkpoint(
        resolve_model(args.model),
        args.out,
        method=args.method,
        bits=args.bits,
        group_size=args.group_size,
        sym=args.sym,
        act_order=args.desc_act,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        num_threads=args.threads,
        mse=args.mse,
        true_sequential=args.true_sequential,
        checkpoint_format=args.checkpoint_format,
    )
    fmt = json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"]
    print(f"wrote a {args.bits}-bit {args.method} checkpoint in {fmt}'s format to {out}:")
    for file in sorted(out.iterdir()):
        print(f"  {file.name:<28} {file.stat().st_size:>12,} bytes")
