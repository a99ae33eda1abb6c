"""``minipaged demo``: `minipaged.demo.run` with its flags."""

from __future__ import annotations

from minipaged.arg_utils import DEFAULT_MODEL, add_model_flag
from minipaged.core.memory.workloads import MEMORY_NUM_REQUESTS

NAME = "demo"
HELP = "a real model answers; the blocks paging saves, measured"
DESCRIPTION = (
    "SmolLM2-135M-Instruct answers chat questions: one streamed token by "
    "token, then a batch sharing a system prompt with n answers each, "
    "with the KV blocks sharing saves and the throughput; then a "
    "ShareGPT-like load on OPT-13B's KV pool, paged vs contiguous."
)


def add_arguments(parser) -> None:
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
        default=MEMORY_NUM_REQUESTS,
        help="requests in the paged-vs-contiguous simulation (default: %(default)s, the "
        "course's workload)",
    )
    parser.add_argument("--seed", type=int, default=0)


def main(args) -> None:
    from minipaged.demo import run  # the engine and torch: only once the demo runs

    run(args.model, args.n, args.max_tokens, args.seed, args.num_requests)
