"""What the benchmarks' commands share beyond the engine flags (`minipaged.arg_utils`):
the model a preset benchmark runs and what its results file says about it, and where a
benchmark writes its results.
"""

from __future__ import annotations

from pathlib import Path

from minipaged.bench.presets import preset_model

MODEL_CONFIG_KEYS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
SYNTHETIC_MODEL_HELP = "the preset's synthetic one, written to the cache"


# -- the model ------------------------------------------------------------------------
def bench_model(args, presets: dict) -> Path:
    """The checkpoint directory a benchmark runs: ``--model``'s, else its preset's (of
    ``presets``, the benchmark's own)."""
    from minipaged.models.hub import resolve_model

    if args.model:
        return resolve_model(args.model)
    return preset_model(args.preset, presets)


def model_record(args, model: Path, device, num_threads: int = 1) -> dict:
    """What a results file says about the model a preset benchmark ran: its preset, its
    name and its shape (not its path: that differs per machine), and torch's threads
    (``num_threads`` on a CPU)."""
    import torch

    from minipaged.models.loader import read_config

    config = read_config(Path(model))
    return {
        "preset": args.preset,
        "model": args.model or f"synthetic: the {args.preset} preset's ({model.name})",
        "model_config": {k: getattr(config, k, None) for k in MODEL_CONFIG_KEYS},
        "torch_threads": num_threads if device.type == "cpu" else torch.get_num_threads(),
    }


# -- where the results go -------------------------------------------------------------
def add_output_flags(parser, name: str) -> None:
    """``--out DIR`` (default: the working directory), ``--json PATH`` or
    ``--update-committed``: where `write` puts the results file ``name.json`` and its
    PNG.  Only ``--update-committed`` writes over the results committed in the checkout,
    so that a run leaves the git tree as it was."""
    group = parser.add_argument_group("results", "a JSON file and a PNG beside it")
    where = group.add_mutually_exclusive_group()
    where.add_argument(
        "--out",
        metavar="DIR",
        default=".",
        help=f"write {name}.json and .png into DIR (default: the current directory)",
    )
    where.add_argument("--json", metavar="PATH", help="write the JSON to PATH, the PNG beside it")
    where.add_argument(
        "--update-committed",
        action="store_true",
        help=f"write over the committed benchmarks/results/<device>/{name}.json "
        "and .png of this checkout",
    )


def results_path(args, name: str, device) -> Path:
    """The JSON file `add_output_flags`' flags name for ``name``'s results on ``device``."""
    from minipaged.bench.results import committed_path

    if args.json:
        return Path(args.json)
    if args.update_committed:
        return committed_path(name, device)
    return Path(args.out) / f"{name}.json"


def write(args, name: str, device, rows: list[dict], figure, **extra) -> Path:
    """Save ``rows`` and ``figure`` where the flags say (`results_path`), with the
    command line, and say where."""
    from minipaged.bench.results import write_results

    path = write_results(
        results_path(args, name, device), rows, device, args.command_line, figure, **extra
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return path
