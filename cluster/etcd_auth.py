"""Users and roles of pdserve's etcd: `EtcdAuth` says who exists; `enable_auth` creates them
and turns etcd's auth on (an etcd that pdserve starts itself: `pdserve up`, benchmarks,
tests); `set_up_auth` does the same on any etcd and, when auth is on already, signs in as
root and sets right what differs (`pdserve etcd-users`); `etcd_users` is `pdserve up`'s plan
— root, a worker user that may write only the cluster's keys and a router user that may only
read them, each password random, in a 0600 file.

Done with etcd's Auth RPCs (the stubs aetcd ships) over a synchronous gRPC channel, so it
runs in a plain thread and needs no etcdctl (tools/gpu/gpu_bundle.py leaves etcdctl out).
"""

from __future__ import annotations

import secrets
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from cluster.etcd_security import EtcdSecurity
from cluster.secret_files import write_secret_file

ROOT = "root"
WORKER_USER = "pdserve-worker"
ROUTER_USER = "pdserve-router"
MIN_PASSWORD_CHARS = 16
"""The shortest password `set_up_auth` sets (`pdserve etcd-users`): a guard against
`changeme`, not a measure of randomness."""


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


class RootRefused(RuntimeError):
    """etcd has auth on and refuses root with the password given."""


@dataclass(frozen=True)
class AuthSetup:
    """What `set_up_auth` did."""

    enabled_now: bool
    """Auth was off: the users were created and auth turned on (else it was on already)."""
    changes: tuple[str, ...] = ()
    """With auth on already: what differed from the plan and was set right (a password, a
    permission, a role); empty when the users were as planned."""


def enable_auth(
    endpoint: str, auth: EtcdAuth, channel_credentials=None, timeout_s: float = 5.0
) -> bool:
    """Create `auth`'s users and roles and enable auth, unless auth is on already (a
    restarted etcd on the same data directory keeps them). True when it enabled it.

    `channel_credentials`: grpc channel credentials for an etcd serving TLS."""
    with _auth_calls(endpoint, channel_credentials, timeout_s) as call:
        if _enabled(call):
            return False
        _enable(call, auth)
    return True


def set_up_auth(
    endpoint: str, auth: EtcdAuth, channel_credentials=None, timeout_s: float = 5.0
) -> AuthSetup:
    """`auth` on any etcd, idempotently (`pdserve etcd-users`). Auth off: as `enable_auth`.
    Auth on: sign in as root with `auth.root_password` (RootRefused when etcd refuses it)
    and make each of `auth.users` exactly as planned: its password, its one role, the role's
    one permission (others are revoked). Every password it sets must have at least
    MIN_PASSWORD_CHARS characters (ValueError, before anything changes)."""
    for user in auth.users:
        _check_new_password(user.name, user.password)
    with _auth_calls(endpoint, channel_credentials, timeout_s) as call:
        if not _enabled(call):
            _check_new_password(ROOT, auth.root_password)
            _enable(call, auth)
            return AuthSetup(enabled_now=True)
        token = _authenticate(call, ROOT, auth.root_password)
        if token is None:
            raise RootRefused(
                f"etcd at {endpoint} has auth on and refuses {ROOT} with the "
                "password given: it is not root's password there"
            )
        as_root = replace(call, metadata=(("token", token),))
        changes = [change for user in auth.users for change in _converge(as_root, user)]
    return AuthSetup(enabled_now=False, changes=tuple(changes))


def _check_new_password(name: str, password: str) -> None:
    if len(password) < MIN_PASSWORD_CHARS:
        raise ValueError(
            f"{name}'s password has {len(password)} characters; use at least "
            f"{MIN_PASSWORD_CHARS}, e.g. `openssl rand -hex 32`"
        )


@dataclass(frozen=True)
class _Calls:
    """etcd's Auth RPCs with one timeout, and root's token once it has signed in."""

    stub: Any
    timeout_s: float
    metadata: tuple[tuple[str, str], ...] = ()

    def __call__(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, timeout=self.timeout_s, metadata=self.metadata)


@contextmanager
def _auth_calls(endpoint: str, channel_credentials, timeout_s: float) -> Iterator[_Calls]:
    import grpc
    from aetcd import rpc

    channel = (
        grpc.secure_channel(endpoint, channel_credentials)
        if channel_credentials
        else grpc.insecure_channel(endpoint)
    )
    with channel:
        yield _Calls(rpc.AuthStub(channel), timeout_s)


def _enabled(call: _Calls) -> bool:
    import grpc
    from aetcd import rpc

    try:
        return call("AuthStatus", rpc.AuthStatusRequest()).enabled
    except grpc.RpcError as exc:
        if "user name is empty" in (exc.details() or ""):
            return True  # on: an anonymous caller is refused
        raise


def _enable(call: _Calls, auth: EtcdAuth) -> None:
    """With auth off (every call allowed): root, the users, then auth on. Also finishes a
    setup that was interrupted before."""
    from aetcd import rpc

    _set_password(call, ROOT, auth.root_password, exists=_roles_of(call, ROOT) is not None)
    call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=ROOT, role=ROOT))
    for user in auth.users:
        _converge(call, user, check_password=False)
    call("AuthEnable", rpc.AuthEnableRequest())


def _converge(call: _Calls, user: EtcdUser, check_password: bool = True) -> list[str]:
    """Make `user` as planned; what was changed. `check_password`: keep a password that
    already signs in (with auth off nothing can sign in: it is set)."""
    from aetcd import rpc

    changes = []
    kind = rpc.Permission.READWRITE if user.write else rpc.Permission.READ
    wanted = rpc.Permission(permType=kind, key=user.prefix, range_end=_prefix_end(user.prefix))
    perms = _perms_of(call, user.name)
    if perms is None:
        call("RoleAdd", rpc.AuthRoleAddRequest(name=user.name))
        changes.append(f"role {user.name} added")
        perms = []
    for perm in perms:
        if perm != wanted:
            call(
                "RoleRevokePermission",
                rpc.AuthRoleRevokePermissionRequest(
                    role=user.name, key=perm.key, range_end=perm.range_end
                ),
            )
            changes.append(f"role {user.name}: revoked {_describe(perm)}")
    if wanted not in perms:
        call("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(name=user.name, perm=wanted))
        changes.append(f"role {user.name}: granted {_describe(wanted)}")
    roles = _roles_of(call, user.name)
    if roles is None or not check_password or _authenticate(call, user.name, user.password) is None:
        _set_password(call, user.name, user.password, exists=roles is not None)
        changes.append(
            f"user {user.name} added" if roles is None else f"user {user.name}: password set"
        )
    for role in roles or ():
        if role != user.name:
            call("UserRevokeRole", rpc.AuthUserRevokeRoleRequest(name=user.name, role=role))
            changes.append(f"user {user.name}: role {role} revoked")
    if user.name not in (roles or ()):
        call("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=user.name, role=user.name))
        changes.append(f"user {user.name}: role {user.name} granted")
    return changes


def _set_password(call: _Calls, name: str, password: str, exists: bool) -> None:
    from aetcd import rpc

    if exists:
        call("UserChangePassword", rpc.AuthUserChangePasswordRequest(name=name, password=password))
    else:
        call("UserAdd", rpc.AuthUserAddRequest(name=name, password=password))


def _authenticate(call: _Calls, name: str, password: str) -> str | None:
    """The token etcd gives `name` for `password`; None when it refuses them."""
    import grpc
    from aetcd import rpc

    try:
        return call("Authenticate", rpc.AuthenticateRequest(name=name, password=password)).token
    except grpc.RpcError as exc:
        if "authentication failed" in (exc.details() or ""):
            return None
        raise


def _roles_of(call: _Calls, name: str) -> list[str] | None:
    """The user's roles; None when there is no such user."""
    from aetcd import rpc

    reply = _unless_not_found(call, "UserGet", rpc.AuthUserGetRequest(name=name))
    return None if reply is None else list(reply.roles)


def _perms_of(call: _Calls, role: str) -> list[Any] | None:
    """The role's permissions; None when there is no such role."""
    from aetcd import rpc

    reply = _unless_not_found(call, "RoleGet", rpc.AuthRoleGetRequest(role=role))
    return None if reply is None else list(reply.perm)


def _unless_not_found(call: _Calls, method: str, request: Any) -> Any:
    import grpc

    try:
        return call(method, request)
    except grpc.RpcError as exc:
        if "not found" in (exc.details() or ""):
            return None
        raise


def _describe(perm: Any) -> str:
    """`read /pdserve/c/*`, `read and write every key from /`, ..."""
    from aetcd import rpc

    kind = (
        "read and write"
        if perm.permType == rpc.Permission.READWRITE
        else ("read" if perm.permType == rpc.Permission.READ else "write")
    )
    key, end = (b.decode(errors="replace") for b in (perm.key, perm.range_end))
    if perm.range_end == _prefix_end(perm.key):
        return f"{kind} {key}*"
    if perm.range_end == b"\0":
        return f"{kind} every key from {key}"
    return f"{kind} {key}" if not end else f"{kind} [{key}, {end})"


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
    flags = {
        name: EtcdSecurity(
            etcd_user=name,
            etcd_password_file=str(
                write_secret_file(secrets_dir / f"etcd-{name}.password", password)
            ),
        )
        for name, password in passwords.items()
    }
    users = (
        EtcdUser(WORKER_USER, passwords[WORKER_USER], prefix, write=True),
        EtcdUser(ROUTER_USER, passwords[ROUTER_USER], prefix, write=False),
    )
    return EtcdUsers(
        EtcdAuth(passwords[ROOT], users, bcrypt_cost=4),
        flags[ROOT],
        flags[WORKER_USER],
        flags[ROUTER_USER],
    )
