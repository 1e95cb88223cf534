"""`pdserve router`: flags (from RouterConfig's fields, engine.flags) -> RouterConfig ->
router.server.serve. Importing this module is cheap (argparse and the config); the HTTP, gRPC
and etcd stacks load when the command runs."""

from __future__ import annotations

import argparse

from engine.flags import add_flags, from_args
from router.config import RouterConfig


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "router",
        help="OpenAI-compatible HTTP front end: places requests on prefill/decode workers",
        description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health, /metrics), placing each request on the decode and prefill workers "
        "registered in etcd.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(p, RouterConfig)
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="the router process's logging level (not part of RouterConfig)",
    )
    p.set_defaults(func=_run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return from_args(RouterConfig, args)


def _run(args: argparse.Namespace) -> int:
    import logging

    from router.server import serve

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(config_from_args(args), log_level=args.log_level)
