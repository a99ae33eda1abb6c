"""The ``minipaged`` command line.

Each subcommand is one ``_add_<name>`` function that declares its arguments and one
``_run_<name>`` function that does the work; `main()` wires them together.  A
``ValueError`` from the library (which always names the bad argument) or an ``OSError``
(a path that cannot be written) becomes a one-line error and exit status 2, like
argparse's own errors, not a traceback.
"""

from __future__ import annotations

import argparse
import sys

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipaged", description="PagedAttention and the vLLM serving engine, step by step.")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_make_tiny_model(subcommands)
    _add_demo(subcommands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog} {args.command}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
