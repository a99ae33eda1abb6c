"""``minipaged serve-ray MODEL --num-replicas N``: replicas of ``minipaged serve`` under
Ray Serve (`minipaged.integrations.ray_serve.serve_ray`), with the same engine flags and
limits."""

from __future__ import annotations

import json

from minipaged.arg_utils import engine_kwargs
from minipaged.commands.serve import add_arguments as add_serve_arguments
from minipaged.commands.serve import server_limits

NAME = "serve-ray"
HELP = "serve replicas of a checkpoint under Ray Serve, one engine each"
DESCRIPTION = (
    "Serve MODEL as minipaged serve does, from N replicas, each its own engine "
    "and KV pool, placed, restarted and autoscaled by Ray Serve on a local or "
    "existing Ray cluster.  Needs the ray extra: pip install 'minipaged[ray]'."
)


def add_arguments(parser) -> None:
    add_serve_arguments(parser)
    group = parser.add_argument_group("Ray Serve")
    group.add_argument(
        "--address",
        help="the Ray cluster to join, e.g. HEAD:6379 or auto (default: $RAY_ADDRESS, "
        "else a local cluster started here)",
    )
    group.add_argument(
        "--num-replicas", type=int, default=1, metavar="N", help="(default: %(default)s)"
    )
    group.add_argument(
        "--autoscaling-config",
        type=json.loads,
        metavar="JSON",
        help='Ray Serve\'s autoscaling, e.g. \'{"min_replicas": 1, "max_replicas": 4}\' '
        "(instead of --num-replicas)",
    )
    group.add_argument(
        "--ray-actor-options",
        type=json.loads,
        metavar="JSON",
        help='each replica\'s resources, e.g. \'{"num_cpus": 4, "num_gpus": 1}\' '
        '(default: {"num_cpus": 1})',
    )


def main(args) -> None:
    from minipaged.integrations.ray_serve import serve_ray  # Ray: the ray extra

    serve_ray(
        args.model,
        args.address,
        args.host,
        args.port,
        args.allowed_hosts,
        num_replicas=args.num_replicas,
        autoscaling_config=args.autoscaling_config,
        ray_actor_options=args.ray_actor_options,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        limits=server_limits(args),
        **engine_kwargs(args),
    )
