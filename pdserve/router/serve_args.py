"""The flags of `pdserve router` and the `RouterCommand` built from them (declared on
`RouterConfig` and `RouterProcess`); the namespace goes no further than this module."""

from __future__ import annotations

import argparse

from pdserve.options import add_options, from_args
from pdserve.router import serve
from pdserve.router.config import RouterConfig
from pdserve.router.serve import RouterCommand, RouterProcess
from pdserve.transfer.release import token_from_env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve router` (declared on `RouterConfig` and `RouterProcess`)."""
    add_options(parser, RouterConfig)
    add_options(parser, RouterProcess)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The `RouterConfig` of parsed `pdserve router` arguments."""
    return from_args(
        RouterConfig,
        args,
        api_key=args.api_key or None,
        cluster_token=token_from_env(args.cluster_token),
    )


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """After parsing: the combination makes a `RouterConfig` (`parser.error` otherwise)."""
    try:
        config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))


def main_from_args(args: argparse.Namespace) -> int:
    """`pdserve router` on its parsed flags."""
    return serve.main(RouterCommand(config_from_args(args), from_args(RouterProcess, args)))
