"""Users and roles of an etcd that pdserve starts itself (`pdserve up`, benchmarks, tests):
`EtcdAuth` says who exists, `enable_auth` creates them and turns etcd's auth on, and
`etcd_users` is `pdserve up`'s plan — root, a worker user that may write only the cluster's
keys and a router user that may only read them, each password random, in a 0600 file.

Done with etcd's Auth RPCs (the stubs aetcd ships) over a synchronous gRPC channel, so it
runs in a plain thread and needs no etcdctl (benchmarks/gpu_bundle.py leaves etcdctl out).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from cluster.etcd_security import EtcdSecurity
from cluster.secret_files import write_secret_file

ROOT = "root"
WORKER_USER = "pdserve-worker"
ROUTER_USER = "pdserve-router"


@dataclass(frozen=True)
class EtcdUser:
    name: str
    password: str
    prefix: bytes
    """The keys it may touch: this prefix and everything under it."""
    write: bool
    """Read and write (else read only)."""

    def __repr__(self) -> str:
        return f"EtcdUser({self.name!r}, prefix={self.prefix!r}, write={self.write})"


@dataclass(frozen=True)
class EtcdAuth:
    """The users an etcd is started with: root (the only one that may change users or see
    every key) and more, each with one role of its own name."""

    root_password: str
    users: tuple[EtcdUser, ...] = ()
    bcrypt_cost: int = 10
    """etcd's --bcrypt-cost for the stored password hashes: every client connection pays one
    bcrypt check (~100 ms at etcd's default 10 on a 2-core EPYC, ~2 ms at 4).
    `etcd_users`'s passwords are random 192-bit tokens, which key stretching cannot make
    stronger, so it uses the minimum, 4."""

    def __repr__(self) -> str:
        return f"EtcdAuth(users={[u.name for u in self.users]})"


def enable_auth(endpoint: str, auth: EtcdAuth, channel_credentials=None,
                timeout_s: float = 5.0) -> bool:
    """Create `auth`'s users and roles and enable auth, unless auth is on already (a
    restarted etcd on the same data directory keeps them). True when it enabled it.

    `channel_credentials`: grpc channel credentials for an etcd serving TLS."""
    import grpc
    from aetcd import rpc

    channel = (grpc.secure_channel(endpoint, channel_credentials) if channel_credentials
               else grpc.insecure_channel(endpoint))
    with channel:
        stub = rpc.AuthStub(channel)
        try:
            stub.AuthStatus(rpc.AuthStatusRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            if "user name is empty" in (exc.details() or ""):
                return False  # on already: an anonymous caller is refused
            raise
        _add_user(stub, ROOT, auth.root_password, timeout_s)
        stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=ROOT, role=ROOT), timeout=timeout_s)
        for user in auth.users:
            _add_role(stub, user.name, timeout_s)
            kind = rpc.Permission.READWRITE if user.write else rpc.Permission.READ
            stub.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
                name=user.name, perm=rpc.Permission(permType=kind, key=user.prefix,
                                                    range_end=_prefix_end(user.prefix))),
                timeout=timeout_s)
            _add_user(stub, user.name, user.password, timeout_s)
            stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user.name, role=user.name),
                               timeout=timeout_s)
        stub.AuthEnable(rpc.AuthEnableRequest(), timeout=timeout_s)
    return True


def _add_user(stub, name: str, password: str, timeout_s: float) -> None:
    """Add the user, or set its password if an earlier, interrupted setup added it."""
    import grpc
    from aetcd import rpc

    try:
        stub.UserAdd(rpc.AuthUserAddRequest(name=name, password=password), timeout=timeout_s)
    except grpc.RpcError as exc:
        if "already exists" not in (exc.details() or ""):
            raise
        stub.UserChangePassword(rpc.AuthUserChangePasswordRequest(name=name, password=password),
                                timeout=timeout_s)


def _add_role(stub, name: str, timeout_s: float) -> None:
    import grpc
    from aetcd import rpc

    try:
        stub.RoleAdd(rpc.AuthRoleAddRequest(name=name), timeout=timeout_s)
    except grpc.RpcError as exc:
        if "already exists" not in (exc.details() or ""):
            raise


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with `prefix` (etcd's rule)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # the whole key space
    end[-1] += 1
    return bytes(end)


@dataclass(frozen=True)
class EtcdUsers:
    """`pdserve up`'s etcd users: the plan its etcd is started with, and the flags each
    kind of process gets (paths to 0600 password files, never the passwords)."""

    auth: EtcdAuth
    root: EtcdSecurity
    worker: EtcdSecurity
    """Read and write under the cluster's prefix: registration, the destination check."""
    router: EtcdSecurity
    """Read only under the cluster's prefix: the router's watch, the planner, `pdserve
    status`."""


def etcd_users(cluster: str, secrets_dir: Path) -> EtcdUsers:
    """Random passwords for root, the worker user and the router user, each written to a 0600
    file in `secrets_dir`; the workers' and router's users see `/pdserve/<cluster>/` only."""
    prefix = f"/pdserve/{cluster}/".encode()
    passwords = {name: secrets.token_urlsafe(24) for name in (ROOT, WORKER_USER, ROUTER_USER)}
    flags = {name: EtcdSecurity(etcd_user=name, etcd_password_file=str(
        write_secret_file(secrets_dir / f"etcd-{name}.password", password)))
        for name, password in passwords.items()}
    users = (EtcdUser(WORKER_USER, passwords[WORKER_USER], prefix, write=True),
             EtcdUser(ROUTER_USER, passwords[ROUTER_USER], prefix, write=False))
    return EtcdUsers(EtcdAuth(passwords[ROOT], users, bcrypt_cost=4), flags[ROOT],
                       flags[WORKER_USER], flags[ROUTER_USER])
