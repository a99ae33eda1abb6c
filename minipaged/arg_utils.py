"""The flags the ``minipaged`` commands and the benchmarks share, as vLLM's
``engine/arg_utils.py`` makes them: one flag per field of a library dataclass (the
engine's ``LLM(...)`` keyword arguments above all, `EngineConfig`), with the field's
type, default and docstring, and the model flag.

Light to import (no torch): ``minipaged --help`` and ``minipaged generate`` import it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import types
import typing

from minipaged.config import (
    ALL2ALL_BACKENDS,
    ATTENTION_BACKENDS,
    DEVICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    MEMORY_MODES,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    RUNNERS,
    TASKS,
    EngineConfig,
)

CHOICES = {
    "device": DEVICES,
    "preemption_mode": PREEMPTION_MODES,
    "memory_mode": MEMORY_MODES,
    "attention_backend": ATTENTION_BACKENDS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "quantization": QUANTIZATION_METHODS,
    "all2all_backend": ALL2ALL_BACKENDS,
    "distributed_executor_backend": DISTRIBUTED_EXECUTOR_BACKENDS,
    "runner": RUNNERS,
    "task": tuple(TASKS),
}


def json_object(text: str) -> dict:
    """A flag's JSON object, as vLLM's ``--speculative-config '{"method": "ngram", ...}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def mode_or_json_object(text: str) -> int | dict:
    """vLLM's ``--compilation-config``: a mode (``1``) or a JSON object (``'{"mode": 1}'``)."""
    return int(text) if text.strip().lstrip("-").isdigit() else json_object(text)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1, or argparse's error naming the flag."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


# Fields whose flag parses its value other than by the field's type.
TYPES = {
    "speculative_config": json_object,
    "compilation_config": mode_or_json_object,
    "pooler_config": json_object,
    "kv_transfer_config": json_object,
    "limit_mm_per_prompt": json_object,
    "structured_outputs_config": json_object,
}
# Not flags: the model is an argument of its own; a trace needs code to read it.
NOT_ENGINE_FLAGS = ("model", "trace")
# vLLM's convention: `serve MODEL`, `--model MODEL` everywhere else; each resolved by
# `minipaged.models.hub.resolve_model`.
DEFAULT_MODEL = "smollm2"
MODEL_HELP = (
    "a Hugging Face checkpoint directory, a .gguf file, smollm2 or a Hugging Face "
    "hub id (fetched once into the cache: see `minipaged download`)"
)


def add_model_flag(parser, default_help: str, default: str | None = None) -> None:
    parser.add_argument(
        "--model", metavar="MODEL", default=default, help=f"{MODEL_HELP} (default: {default_help})"
    )


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


def add_fields(group, cls, names, flags: dict[str, str] | None = None) -> dict[str, str]:
    """One flag per dataclass field in ``names``, with the field's default, type and
    docstring; ``flags`` renames some (field -> flag without dashes).  Returns the
    map field -> argparse dest, for `field_kwargs`."""
    hints, docs = typing.get_type_hints(cls), _field_docs(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    dests = {}
    for name in names:
        flag = (flags or {}).get(name, name.replace("_", "-"))
        kind = hints[name]
        if name in TYPES:
            kind = TYPES[name]
        elif isinstance(kind, types.UnionType):  # int | None: an optional int
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        help_ = f"{docs.get(name, '')} (default: %(default)s)"
        if kind is bool:
            action = group.add_argument(
                f"--{flag}",
                action=argparse.BooleanOptionalAction,
                default=defaults[name],
                help=help_,
            )
        else:
            action = group.add_argument(
                f"--{flag}",
                type=kind,
                default=defaults[name],
                choices=CHOICES.get(name) if cls is EngineConfig else None,
                metavar=_metavar(name, kind),
                help=help_,
            )
        dests[name] = action.dest
    return dests


def _metavar(name, kind) -> str | None:
    if name in CHOICES:
        return None  # argparse shows {a,b,c}
    return {int: "N", float: "X", json_object: "JSON", mode_or_json_object: "MODE|JSON"}.get(
        kind, name.upper()
    )


def field_kwargs(args, dests: dict[str, str]) -> dict:
    """The values of the flags `add_fields` made, by field name."""
    return {name: getattr(args, dest) for name, dest in dests.items()}


def add_engine_flags(parser, exclude=()) -> None:
    """The ``LLM`` keyword arguments (`EngineConfig`'s fields) as flags, with vLLM's
    names: ``--block-size 16``, ``--enable-prefix-caching``, ``--seed 0``, ...;
    `engine_kwargs` turns them back into keyword arguments."""
    group = parser.add_argument_group(
        "engine flags", "LLM(...) keyword arguments (minipaged.config.EngineConfig)"
    )
    names = [
        f.name
        for f in dataclasses.fields(EngineConfig)
        if f.name not in (*NOT_ENGINE_FLAGS, *exclude)
    ]
    parser.set_defaults(engine_dests=add_fields(group, EngineConfig, names))


def engine_kwargs(args) -> dict:
    """The engine flags of parsed ``args`` as ``LLM(model, **kwargs)`` keyword arguments."""
    return field_kwargs(args, args.engine_dests)
