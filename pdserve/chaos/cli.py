"""`pdserve chaos` / `python -m pdserve.chaos`: the command line of a chaos run (run.py).
Defining the flags imports nothing heavy (`pdserve --help` stays cheap)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve.chaos.faults import KINDS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="seconds of faults under load")
    p.add_argument("--fault-interval", type=float, default=6.0, help="seconds between faults")
    p.add_argument(
        "--faults", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}"
    )
    p.add_argument(
        "--stall", type=float, default=4.0, help="seconds a stalled worker stays stopped"
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=1.5,
        help="the router's --stall-timeout for the run (its default, 60 s, is for "
        "production; below --stall, stalled requests migrate)",
    )
    p.add_argument("--concurrency", type=int, default=6, help="clients streaming at once")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (ignore_eos)")
    p.add_argument(
        "--cancel-share",
        type=float,
        default=0.1,
        help="share of requests the client closes at a random token",
    )
    p.add_argument("--prefill", type=int, default=2, help="prefill workers")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument(
        "--full-model",
        action="store_true",
        help="serve the whole model (default: 2 layers, float32, like the tests)",
    )
    p.add_argument("--up-arg", action="append", default=[], help="extra flag for `pdserve up`")
    p.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.25,
        help="largest allowed relative RSS growth of a process that lived through the "
        "run (workers touch their KV pool's pages as they first use them)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the cluster's logs here")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "chaos",
        help="faults under load against a fresh `pdserve up` cluster; exit 1 on any "
        "failed request, leaked KV block or inconsistency (see docs/chaos.md)",
    )
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from pdserve.chaos.run import main

    return main(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.chaos")
    add_arguments(p)
    return _run(p.parse_args(argv))
