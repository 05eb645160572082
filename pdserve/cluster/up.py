"""The `pdserve up` command: `pdserve.launcher`'s cluster on one host, or with `--ray` the
same cluster on Ray (`pdserve.cluster.ray_up`).

Here, above both, so that the launcher knows nothing of Ray: this module adds the Ray and
planner flags to the launcher's and sends a parsed command to the one that runs it.
"""

from __future__ import annotations

import argparse
import sys

from pdserve import launcher
from pdserve.cluster import local_up, ray_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags, then `--ray` and the planner's."""
    launcher.add_arguments(parser)
    ray_args.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """Run `pdserve up` on one host, or on Ray with `--ray`."""
    on = ray_args.up_on_ray(args)
    if on.ray:
        from pdserve.cluster.ray_up import main as ray_main  # imports Ray only when asked

        return ray_main(args)
    if on.planner or args.ray_address:
        print("pdserve up: --planner and --ray-address need --ray", file=sys.stderr)
        return 2
    return local_up.main(args)
