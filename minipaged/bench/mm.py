"""``minipaged bench mm``: a multimodal workload whose images repeat, through LLaVA.

Requests draw their image from a small seeded pool, so most images come back; each has
its own question (no two prompts alike, and prefix caching off in every run, so every
encoder run saved is the encoder cache's own doing).  Three runs of the same requests:

- ``all images``: an encoder cache with room for every image (vLLM's
  ``EncoderCacheManager``) encodes each distinct image once;
- ``one image``: room for a single image encodes an image again whenever another came
  in between, and admits together only requests that share one image (a request waits
  for its image's room), so it also runs smaller batches;
- ``no repeats`` (the baseline): every request's image made unique (one pixel changed),
  so every request is encoded, the batches as in ``all images``.

Per run: images encoded, the encoder cache's hit rate, seconds and requests/s, and the
speed-up over the baseline.  The first two runs' greedy tokens must be equal (the
cache changes no result).
"""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from minipaged.arg_utils import add_engine_flags, engine_kwargs
from minipaged.bench import common
from minipaged.bench.args import add_output_flags, write
from minipaged.bench.common import Column

NAME = "mm"
HELP = "multimodal: the encoder cache's hit rate and what it saves when images repeat"
DESCRIPTION = (
    "Requests whose images repeat (drawn from a small seeded pool), through a LLaVA "
    "checkpoint with an encoder cache that holds every image against one that holds one "
    "image: images encoded, hit rate, requests/s and the speed-up; greedy tokens equal."
)


def workload(num_requests: int, num_images: int, image_size: int, seed: int):
    """``num_requests`` (question, image index) pairs and ``num_images`` seeded noise
    pictures; the indices drawn uniformly, so images repeat, in no particular order."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    images = [
        Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
        for _ in range(num_images)
    ]
    picks = rng.integers(0, num_images, num_requests).tolist()
    return [
        (f"USER: <image>\nQuestion {i}: what is it? ASSISTANT:", k) for i, k in enumerate(picks)
    ], images


def unique(image, i: int):
    """``image`` with one pixel set from ``i``: another hash, the same size."""
    image = image.copy()
    image.putpixel((0, 0), (i % 256, i // 256 % 256, 7 if i >= 0 else 8))
    return image


def run(path, requests, images: list, kwargs: dict, max_tokens: int) -> dict:
    """``requests``' questions, the ``i``-th with ``images[i]``, through one engine."""
    from minipaged import LLM, SamplingParams

    llm = LLM(path, **kwargs)
    prompts = [
        {"prompt": q, "multi_modal_data": {"image": image}}
        for (q, _), image in zip(requests, images)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    # Warm-up, with an image no request has (it counts in no statistic below).
    warm = {**prompts[0], "multi_modal_data": {"image": unique(images[0], -1)}}
    llm.generate(warm, params, use_tqdm=False)
    before = llm.stats()
    outputs, seconds = common.timed(
        lambda: llm.generate(prompts, params, use_tqdm=False), torch.device("cpu")
    )
    after = llm.stats()
    count = {k: after[k] - before[k] for k in ENCODER_COUNTS}
    return {
        "seconds": seconds,
        "requests_per_s": len(requests) / seconds,
        "num_encoded_images": count["num_encoded_images"],
        "encoder_cache_hit_rate": count["encoder_cache_hits"] / count["encoder_cache_queries"],
        "tokens": [o.outputs[0].token_ids for o in outputs],
    }


ENCODER_COUNTS = ("num_encoded_images", "encoder_cache_hits", "encoder_cache_queries")
COLUMNS = [
    Column("encoder cache", "system"),
    Column("images encoded", "num_encoded_images", "{:d}"),
    Column("hit rate", "encoder_cache_hit_rate", "{:.2f}"),
    Column("requests/s", "requests_per_s", "{:.2f}"),
    Column("vs no repeats", "speedup", "{:.2f}x"),
]


def plot(rows: list[dict]) -> Figure:
    fig = Figure(figsize=(8, 3.5))
    left, right = fig.subplots(1, 2)
    names = [r["system"] for r in rows]
    left.bar(names, [r["num_encoded_images"] for r in rows], color="tab:orange")
    left.set(ylabel="images encoded", title="encoder runs")
    right.bar(names, [r["requests_per_s"] for r in rows], color="tab:blue")
    right.set(ylabel="requests/s", title="throughput, CPU")
    fig.tight_layout()
    return fig


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model", default=None, help="a LLaVA checkpoint (default: the tiny random one)"
    )
    parser.add_argument("--num-requests", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument(
        "--num-images", type=int, default=8, help="distinct images (default: %(default)s)"
    )
    parser.add_argument("--image-size", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--num-threads", type=int, default=1, help="(default: %(default)s)")
    add_engine_flags(
        parser, exclude=("encoder_cache_size", "enable_prefix_caching", "device", "dtype")
    )
    add_output_flags(parser, NAME)


def main(args) -> None:
    from minipaged.models.hub import resolve_model
    from minipaged.models.llava import num_image_tokens
    from minipaged.models.loader import read_config
    from minipaged.models.tiny import cached_checkpoint

    for name in ("num_requests", "num_images", "image_size", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    path = resolve_model(args.model) if args.model else cached_checkpoint("tiny-llava", "llava")
    requests, images = workload(args.num_requests, args.num_images, args.image_size, seed=0)
    base = {**engine_kwargs(args), "device": "cpu", "enable_prefix_caching": False}
    one_image = num_image_tokens(read_config(path))
    drawn = [images[k] for _, k in requests]
    every = args.num_requests * one_image
    runs = {
        "all images": (drawn, every),
        "one image": (drawn, one_image),
        "no repeats": ([unique(image, i) for i, image in enumerate(drawn)], every),
    }
    results = {}
    with common.cpu_threads("cpu", common.check_num_threads(args.num_threads)):
        for system, (pictures, size) in runs.items():
            results[system] = run(
                path, requests, pictures, {**base, "encoder_cache_size": size}, args.max_tokens
            )
    if results["all images"]["tokens"] != results["one image"]["tokens"]:
        raise AssertionError("the encoder cache changed a greedy completion")
    baseline = results["no repeats"]["seconds"]
    rows = [
        {"system": system, **{k: v for k, v in r.items() if k != "tokens"}}
        for system, r in results.items()
    ]
    for row in rows:
        row["speedup"] = baseline / row["seconds"]
    print(
        f"{args.num_requests} requests over {args.num_images} distinct "
        f"{args.image_size}x{args.image_size} images (prefix caching off)"
    )
    print(common.format_table(rows, COLUMNS))
    write(
        args,
        NAME,
        torch.device("cpu"),
        rows,
        plot(rows),
        model=str(path),
        num_requests=args.num_requests,
        num_images=args.num_images,
        num_threads=args.num_threads,
    )
