"""`pdserve role --worker HOST:PORT [prefill|decode]`: show or switch the role a running worker
serves (`Worker.SetRole`: the old role drains, the engine and its prefix cache are kept, the
etcd registration moves to the new role's key; worker_runtime/roles.py). It presents the
cluster token (--cluster-token-file or PDSERVE_CLUSTER_TOKEN; `pdserve up` prints its file)
and TLS identity the worker asks for."""

from __future__ import annotations

import argparse
import sys

from cluster.grpc_security import GROUP as GRPC_SECURITY_GROUP
from cluster.grpc_security import GrpcSecurity, resolve
from cluster.roles import ROLES
from engine.flags import add_flags, from_args


def _run(args: argparse.Namespace) -> int:
    import os

    import grpc

    from cluster.grpc_auth import channel as grpc_channel
    from proto import pdserve_pb2 as pb
    from proto import pdserve_pb2_grpc as pb_grpc

    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout:g}")
    auth = resolve(from_args(GrpcSecurity, args), os.environ)
    with grpc_channel(args.worker, auth) as channel:
        stub = pb_grpc.WorkerStub(channel)
        try:
            if args.role is None:
                health = stub.Health(pb.HealthRequest(), timeout=10)
                print(
                    f"{health.worker_id}: {health.role}"
                    + (" (draining)" if health.draining else "")
                )
                return 0
            # The worker may drain for --drain-timeout (0: its own) before it answers.
            reply = stub.SetRole(
                pb.SetRoleRequest(role=args.role, drain_timeout_s=args.drain_timeout),
                timeout=args.timeout,
            )
        except grpc.RpcError as exc:
            print(
                f"pdserve role: {args.worker}: {exc.code().name}: {exc.details()}", file=sys.stderr
            )
            return 1
    change = (
        f"{reply.previous_role} -> {reply.role}"
        if reply.previous_role != reply.role
        else f"{reply.role} (unchanged)"
    )
    print(f"{args.worker}: {change}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "role",
        help="show or switch the role (prefill / decode) of a running worker without restarting it",
        description="Without ROLE: print the worker's role. With ROLE: switch it (the worker "
        "must have been started with --enable-admin-rpcs). The old "
        "role drains first (the worker is published as draining; in-flight "
        "requests finish, and those left after --drain-timeout are aborted: "
        "decode streams are migrated by the router, prefills are redone locally "
        "by their decode worker); the engine and its prefix cache are kept; the "
        "etcd registration moves to the new role. Switching to the role served "
        "now changes nothing.",
    )
    p.add_argument(
        "--worker",
        required=True,
        metavar="HOST:PORT",
        help="the worker's gRPC address (its READY line's grpc=)",
    )
    p.add_argument("role", nargs="?", choices=ROLES, help="the role to serve from now on")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        help="seconds in-flight requests may take before they are aborted "
        "(0 = the worker's own --drain-timeout)",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the worker's answer"
    )
    add_flags(p, GrpcSecurity, group=GRPC_SECURITY_GROUP)  # what the worker's port asks for
    p.set_defaults(func=_run)
