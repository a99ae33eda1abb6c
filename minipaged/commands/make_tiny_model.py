"""``minipaged make-tiny-model DIR``: write `minipaged.models.tiny.make_tiny_model`'s
checkpoint and list its files."""

from __future__ import annotations

from minipaged.models.tiny import ARCHS, VISION_ARCHS, make_tiny_model

NAME = "make-tiny-model"
HELP = "write a tiny seeded random Hugging Face checkpoint"
DESCRIPTION = (
    "Write a tiny random checkpoint (config.json, model.safetensors and a "
    "byte-level tokenizer) that transformers and minipaged both load."
)


def add_arguments(parser) -> None:
    parser.add_argument("dir", help="directory to write (created if missing)")
    parser.add_argument("--arch", choices=[*sorted(ARCHS), *VISION_ARCHS], default="llama")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same weights")


def main(args) -> None:
    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} checkpoint (seed {args.seed}) to {path}:")
    for file in sorted(path.iterdir()):
        print(f"  {file.name:<24} {file.stat().st_size:>10,} bytes")
