"""`pdserve etcd-users --etcd HOST:PORT`: give an etcd that pdserve does not start (compose,
Kubernetes, your own) the users and roles `pdserve up` gives its own — root,
`pdserve-worker` (read and write under /pdserve/<cluster>/) and `pdserve-router` (read only
there) — and turn its auth on. Idempotent: on an etcd whose auth is on it signs in as root
and sets right only what differs. Passwords come from files or variables, never flags.

Exit status: 0 set up (now or before), 1 etcd refused root's password or could not be
reached, 2 a flag, a password or a file is wrong."""

from __future__ import annotations

import argparse
import os
import sys

from cluster.etcd_users_config import EtcdUsersConfig
from engine.flags import add_flags, from_args

DESCRIPTION = (
    "Create etcd users for a pdserve cluster and turn etcd's auth on, as `pdserve up` does for "
    "its own etcd: root, the workers' user (read and write under /pdserve/<cluster>/) and "
    "the router's (read only there). Passwords: each from its file's first line, else "
    "PDSERVE_ETCD_ROOT_PASSWORD / PDSERVE_ETCD_WORKER_PASSWORD / PDSERVE_ETCD_ROUTER_PASSWORD; "
    "each at least 16 characters (e.g. `openssl rand -hex 32`). Safe to run again: with auth "
    "on already it signs in as root and changes only what differs (a new password, a stray "
    "permission), or nothing. The password hashes are made at the etcd server's "
    "--bcrypt-cost, which this command cannot change (docs/security.md)."
)


def _run(args: argparse.Namespace) -> int:
    import grpc

    from cluster.etcd_auth import RootRefused, set_up_auth
    from cluster.etcd_client import channel_credentials, parse_endpoint

    config: EtcdUsersConfig = from_args(EtcdUsersConfig, args)
    auth = config.plan(os.environ)
    tls = config.tls.read_tls()
    endpoint = "%s:%d" % parse_endpoint(config.etcd)
    try:
        done = set_up_auth(endpoint, auth, tls and channel_credentials(tls), config.timeout)
    except RootRefused as exc:
        print(
            f"pdserve etcd-users: error: {exc} (--root-password-file or "
            "PDSERVE_ETCD_ROOT_PASSWORD)",
            file=sys.stderr,
        )
        return 1
    except grpc.RpcError as exc:
        print(
            f"pdserve etcd-users: error: etcd at {endpoint}: {exc.code().name}: {exc.details()}",
            file=sys.stderr,
        )
        return 1
    prefix = config.prefix.decode()
    users = (
        f"{auth.users[0].name} (read and write {prefix}), {auth.users[1].name} (read only {prefix})"
    )
    if done.enabled_now:
        print(f"etcd {endpoint}: auth enabled; users root, {users}")
    elif done.changes:
        print(f"etcd {endpoint}: auth was on; changed: " + "; ".join(done.changes))
    else:
        print(f"etcd {endpoint}: auth already on with these users: root, {users}; nothing changed")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "etcd-users",
        help="create the workers' and router's etcd users on an etcd pdserve "
        "does not start, and turn its auth on",
        description=DESCRIPTION,
        allow_abbrev=False,
    )  # `--root-password x` must not pass for --root-password-file
    add_flags(p, EtcdUsersConfig)
    p.set_defaults(func=_run)
