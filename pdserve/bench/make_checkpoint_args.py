"""`pdserve bench make-checkpoint` on its parsed flags: the `MakeCheckpointConfig` they
describe, handed to `pdserve.bench.make_checkpoint.run`; the namespace goes no further than
this module."""

from __future__ import annotations

import argparse

from pdserve.bench import make_checkpoint
from pdserve.bench.make_checkpoint import CheckpointShape, MakeCheckpointConfig, add_arguments
from pdserve.options import from_args

__all__ = ["add_arguments", "config_from_args", "main_from_args"]


def config_from_args(args: argparse.Namespace) -> MakeCheckpointConfig:
    """The `MakeCheckpointConfig` of parsed flags."""
    return from_args(MakeCheckpointConfig, args, shape=from_args(CheckpointShape, args))


def main_from_args(args: argparse.Namespace) -> int:
    """Write the checkpoint of the parsed flags; 1 if the directory exists without --force."""
    return make_checkpoint.run(config_from_args(args))
