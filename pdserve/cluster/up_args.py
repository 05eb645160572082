"""The flags of `pdserve up` and the configs built from them: `pdserve.launcher`'s cluster on
one host (`pdserve.cluster.local_up`), or with `--ray` the same cluster on Ray
(`pdserve.cluster.ray_up`).

Here, above both, so that the launcher knows nothing of Ray nor of argparse's namespace:
this module adds the launcher's flags (declared on `ClusterConfig`, `ClusterMode`,
`UpProcess` and `RestartPolicy`) and the Ray and planner flags (pdserve.cluster.ray_args),
then sends the configs of a parsed command to the one that runs it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from pdserve.cluster import local_up, ray_args
from pdserve.launcher import ClusterConfig
from pdserve.options import add_options, from_args, option
from pdserve.restarts import SUPERVISION_GROUP, RestartPolicy


@dataclass(frozen=True)
class UpProcess:
    """What `pdserve up` itself does after the cluster stops (`LocalUpCommand.keep_logs`)."""

    keep_logs: bool = option(
        False,
        help="keep the temporary log folder after a clean exit (it is always kept after a "
        "failure, and a --log-dir is never deleted)",
    )


@dataclass(frozen=True)
class ClusterMode:
    """`--monolithic`, the alternative to `--kv-transfer` (one of the two is required):
    `config_from_args` makes it `ClusterConfig.kv_transfer` None."""

    monolithic: bool = option(False, help="one --role both instance and no router (the baseline)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags (everything after `--` goes to every instance), then `--ray`
    and the planner's."""
    mode = parser.add_mutually_exclusive_group(required=True)
    add_options(mode, ClusterConfig, only=("kv_transfer",))
    add_options(mode, ClusterMode)
    add_options(parser, ClusterConfig, only=_CLUSTER_FLAGS)
    add_options(parser, UpProcess)
    add_options(parser, ClusterConfig, only=("pin_cores", "cores", "startup_timeout_s"))
    parser.add_argument_group(
        SUPERVISION_GROUP,
        "A process that dies (prefill, decode or router) is started again on the same ports, "
        "after a backoff that doubles from --restart-backoff up to --restart-backoff-max; the "
        "others keep serving meanwhile. After more than --max-restarts failures within "
        "--restart-window seconds it is given up: without prefill instances the cluster goes "
        "on (the router prefills on the decode instances); without the router, any decode "
        "instance or (--monolithic) the instance it stops, with exit status 1.",
    )
    add_options(parser, RestartPolicy)
    # A positional (options.py declares flags only): handed to `from_args` as computed.
    parser.add_argument(
        "instance_args", nargs=argparse.REMAINDER, help="-- then extra arguments for every instance"
    )
    ray_args.add_arguments(parser)


# ClusterConfig's flags listed between the mode and `--keep-logs`, in `--help`'s order.
_CLUSTER_FLAGS = (
    "num_prefill",
    "num_decode",
    "transport",
    "engine",
    "connector",
    "vllm_python",
    "model",
    "host",
    "port",
    "policy",
    "local_prefill_below",
    "api_key",
    "cluster_token",
    "request_timeout_s",
    "router_log_level",
    "log_dir",
)


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    """The `RestartPolicy` of parsed `pdserve up` arguments (ValueError if inconsistent)."""
    return from_args(RestartPolicy, args)


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The `ClusterConfig` of parsed `pdserve up` arguments."""
    extra = list(args.instance_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return from_args(
        ClusterConfig,
        args,
        kv_transfer=None if from_args(ClusterMode, args).monolithic else args.kv_transfer,
        api_key=args.api_key or None,
        cluster_token=args.cluster_token or None,
        instance_args=tuple(extra),
    )


def main_from_args(args: argparse.Namespace) -> int:
    """Run `pdserve up` on one host, or on Ray with `--ray`; 2 for flags that cannot work
    together (before anything starts)."""
    on = ray_args.up_on_ray(args)
    if on.ray:
        return _on_ray(args, on.planner)
    if on.planner or args.ray_address:
        print("pdserve up: --planner and --ray-address need --ray", file=sys.stderr)
        return 2
    try:
        policy = restart_policy_from_args(args)
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 2
    up = local_up.LocalUpCommand(
        config_from_args(args), policy, keep_logs=from_args(UpProcess, args).keep_logs
    )
    return local_up.main(up)


def _on_ray(args: argparse.Namespace, planner: bool) -> int:
    from pdserve.cluster import ray_up  # imports Ray only when asked

    if from_args(ClusterMode, args).monolithic:
        print("pdserve up: --ray starts a P/D cluster (use --kv-transfer)", file=sys.stderr)
        return 2
    try:
        config = ray_args.ray_config_from_args(args, config_from_args(args))
        planner_config = ray_args.planner_config_from_args(args) if planner else None
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 2
    return ray_up.main(ray_up.RayUpCommand(config, planner_config))
