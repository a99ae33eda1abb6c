"""The ``minipaged`` command line.

Each subcommand is one ``_add_<name>`` function that declares its arguments and one
``_run_<name>`` function that does the work; `main()` wires them together.  A
``ValueError`` from the library (which always names the bad argument) or an ``OSError``
(a path that cannot be written) becomes a one-line error and exit status 2, like
argparse's own errors, not a traceback.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from minipaged.bench import attention as attention_bench
from minipaged.bench.results import default_path, write_results
from minipaged.models.tiny import ARCHS, make_tiny_model


def _add_make_tiny_model(subcommands) -> None:
    parser = subcommands.add_parser(
        "make-tiny-model", help="write a tiny seeded random Hugging Face checkpoint",
        description="Write a tiny random checkpoint (config.json, model.safetensors and a "
                    "byte-level tokenizer) that transformers and minipaged both load.")
    parser.add_argument("dir", help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same weights")
    parser.set_defaults(run=_run_make_tiny_model)


def _run_make_tiny_model(args) -> None:
    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} checkpoint (seed {args.seed}) to {path}:")
    for file in sorted(path.iterdir()):
        print(f"  {file.name:<24} {file.stat().st_size:>10,} bytes")


def _add_demo(subcommands) -> None:
    parser = subcommands.add_parser(
        "demo", help="what paging buys: KV memory waste and sharing, measured",
        description="Serve a ShareGPT-like load on OPT-13B's KV pool, paged vs contiguous, "
                    "and count the blocks that copy-on-write and prefix caching save.")
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=_run_demo)


def _run_demo(args) -> None:
    from minipaged.demo import sharing_report, waste_report

    print(waste_report(args.num_requests, args.seed))
    print()
    print(sharing_report())


def _add_bench(subcommands) -> None:
    parser = subcommands.add_parser(
        "bench", help="benchmarks: print a table, save JSON and a PNG",
        description="Each benchmark prints its numbers and saves JSON plus a PNG beside it "
                    "under benchmarks/results/<device>/ unless --json says otherwise.")
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _add_bench_attention(benches)


def _add_bench_attention(benches) -> None:
    parser = benches.add_parser(
        "attention", help="attention ops per backend vs the GPU's read bandwidth",
        description="Time paged decode and prefill for each backend, the same kernel over "
                    "a contiguous cache, and torch's scaled_dot_product_attention, and "
                    "report each as a fraction of the measured streaming-read bandwidth.")
    parser.add_argument("--preset", choices=sorted(attention_bench.PRESETS),
                        default=attention_bench.default_preset(),
                        help="gpu: the goal shapes on CUDA; cpu: tiny shapes on the CPU "
                             "(default: gpu if CUDA is available)")
    parser.add_argument("--ops", nargs="+", choices=attention_bench.OPS, metavar="OP",
                        default=list(attention_bench.OPS),
                        help=f"any of {', '.join(attention_bench.OPS)} (default: all)")
    parser.add_argument("--backends", nargs="+", choices=attention_bench.BACKENDS,
                        metavar="BACKEND", default=list(attention_bench.BACKENDS),
                        help=f"any of {', '.join(attention_bench.BACKENDS)} (default: all)")
    for flag in ("--batch", "--context-len", "--num-heads", "--num-kv-heads", "--head-dim",
                 "--block-size"):
        parser.add_argument(flag, type=int, metavar="N",
                            help="override it in every shape of the preset")
    parser.add_argument("--dtype", choices=list(attention_bench.DTYPES),
                        help="override it in every shape of the preset")
    parser.add_argument("--json", help="where to write the results (default: "
                        "benchmarks/results/<device>/attention.json); the PNG goes beside it")
    # Errors then read "minipaged bench attention: error: ...".
    parser.set_defaults(run=_run_bench_attention, command="bench attention")


def _run_bench_attention(args) -> None:
    shapes = attention_bench.make_shapes(
        args.preset, args.ops, batch=args.batch, context_len=args.context_len,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
        block_size=args.block_size, dtype=args.dtype)
    device = attention_bench.preset_device(args.preset)
    bench = attention_bench.bench_attention(shapes, args.backends, device)
    print(attention_bench.format_table(bench))
    path = write_results(args.json or default_path("attention", device), bench.rows, device,
                         args.command_line, attention_bench.plot_fractions(bench.rows),
                         preset=args.preset, read_bandwidth_gbs=bench.read_bandwidth_gbs,
                         notes=bench.notes)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipaged", description="PagedAttention and the vLLM serving engine, step by step.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_make_tiny_model(subcommands)
    _add_demo(subcommands)
    _add_bench(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = shlex.join([parser.prog, *argv])  # what results files record
    try:
        args.run(args)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog} {args.command}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
