"""``minipaged serve MODEL``: `minipaged.server.app.serve` with the engine flags and the
server's limits (docs/serving-safely.md)."""

from __future__ import annotations

import dataclasses
import os

from minipaged.arg_utils import MODEL_HELP, add_engine_flags, engine_kwargs, positive_int
from minipaged.server.limits import TOOL_CALL_PARSERS, ServerLimits

NAME = "serve"
HELP = "serve a checkpoint over an OpenAI-compatible HTTP API"
DESCRIPTION = (
    "Serve MODEL at /v1/completions and /v1/chat/completions (streaming "
    "with server-sent events), /v1/models, /health and /metrics, until "
    "interrupted.  Needs the server extra: pip install 'minipaged[server]'."
)


def add_arguments(parser) -> None:
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
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve beside the model, a request's "
        "'model' naming one (needs --enable-lora)",
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        metavar="N",
        help="engine replicas, each a process with its own KV pool (and its own "
        "--tensor-parallel-size ranks), behind this one server, which sends each "
        "request to the least loaded (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice "auto" (the default with tools) read tool calls from the '
        "model's text (needs --tool-call-parser)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        help="how tool calls are written in the model's text: hermes is "
        "<tool_call>{...}</tool_call>",
    )
    _add_safety_flags(parser)
    add_engine_flags(parser)


def _add_safety_flags(parser) -> None:
    """The server's limits (`ServerLimits`) and allowed hosts; see
    docs/serving-safely.md."""
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
        (
            "--read-timeout",
            "read_timeout_s",
            float,
            "seconds a request body may pause (408), and a connection waits for a request",
        ),
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


def server_limits(args) -> ServerLimits:
    """The limits flags of parsed ``args``."""
    return ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})


def main(args) -> None:
    from minipaged.server.app import serve  # FastAPI and uvicorn: the server extra

    serve(
        args.model,
        args.host,
        args.port,
        args.api_key,
        args.served_model_name,
        server_limits(args),
        args.allowed_hosts,
        args.lora_modules,
        args.data_parallel_size,
        args.enable_auto_tool_choice,
        args.tool_call_parser,
        **engine_kwargs(args),
    )
