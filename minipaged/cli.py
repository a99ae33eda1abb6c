"""The ``minipaged`` command line.

Each command is a module that declares and runs itself: ``NAME``, ``HELP`` and
``DESCRIPTION``, ``add_arguments(parser)`` and ``main(args)``.  The modules of
`minipaged.commands` are the commands (`COMMANDS`); those of `minipaged.bench` the
benchmarks, ``minipaged bench NAME`` (`BENCHES`).  A command's module is imported only
when the command line names it, so ``minipaged --help`` starts without torch.  A
``ValueError`` from the library (which always names the bad argument) or an ``OSError``
(a path that cannot be written) becomes a one-line error and exit status 2, like
argparse's own errors, not a traceback.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import shlex
import sys
from pathlib import Path

# The modules behind `minipaged COMMAND` and `minipaged bench NAME`, in the order the
# help lists them.
COMMANDS = (
    "make_tiny_model",
    "download",
    "quantize",
    "generate",
    "demo",
    "serve",
    "serve_ray",
    "disagg_proxy",
    "check",
)
BENCHES = (
    "memory",
    "sharing",
    "prefix",
    "attention",
    "throughput",
    "serve",
    "chaos",
    "blocksize",
    "preemption",
    "latency",
    "spec",
    "kv_cache_dtype",
    "lora",
    "moe",
    "cpu_step",
    "quant",
    "mla",
    "embed",
    "mm",
    "structured",
    "structured_acceptance",
    "disagg",
)


class _LazyParser(argparse.ArgumentParser):
    """A command's parser: its module is imported, and adds its arguments, only when the
    command line names it."""

    def __init__(self, *args, module: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.module = module

    def parse_known_args(self, args=None, namespace=None):
        if self.module:
            try:
                command = importlib.import_module(self.module)
            except ModuleNotFoundError as error:
                if error.name != "httpx":
                    raise
                self.error("needs httpx, of the server extra: pip install 'minipaged[server]'")
            command.add_arguments(self)
            # main()'s errors then read "minipaged bench NAME: error: ...".
            self.set_defaults(run=command.main, prog=self.prog)
            self.module = None
        return super().parse_known_args(args, namespace)


def _add_commands(subparsers, package: str, modules: tuple[str, ...]) -> None:
    """One lazily built parser per module of ``package``, named and described from its
    source."""
    for module in modules:
        constants = _constants(f"{package}.{module}")
        subparsers.add_parser(
            constants["NAME"],
            help=constants["HELP"],
            description=constants["DESCRIPTION"],
            module=f"{package}.{module}",
        )


def _constants(module: str) -> dict[str, str]:
    """A command module's NAME, HELP and DESCRIPTION, read from its source: importing a
    benchmark loads torch (seconds), and serve and chaos need the server extra."""
    source = Path(importlib.util.find_spec(module).origin).read_text()
    return {
        target.id: ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id in ("NAME", "HELP", "DESCRIPTION")
    }


def _add_bench(subcommands) -> None:
    parser = subcommands.add_parser(
        "bench",
        help="benchmarks: print a table, save JSON and a PNG",
        description="Each benchmark prints its numbers and saves JSON plus a PNG beside it "
        "in the current directory, or where --out or --json says; "
        "--update-committed writes over the results committed under "
        "benchmarks/results/<device>/.",
    )
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _add_commands(benches, "minipaged.bench", BENCHES)


def build_parser() -> argparse.ArgumentParser:
    parser = _LazyParser(
        prog="minipaged", description="PagedAttention and the vLLM serving engine, step by step."
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_commands(subcommands, "minipaged.commands", COMMANDS)
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
        parser.exit(2, f"{args.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
