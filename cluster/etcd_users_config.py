"""`pdserve etcd-users`' config: which etcd, which cluster, where the three passwords come from
(a file or a variable, never a flag: `ps` would show it), and `plan`, the `EtcdAuth` they
make — the users and roles `pdserve up` gives its own etcd (cluster/etcd_auth.py).

Stdlib-only: `pdserve --help` imports it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from cluster.etcd_auth import ROOT, ROUTER_USER, WORKER_USER, EtcdAuth, EtcdUser
from cluster.etcd_client import parse_endpoint
from cluster.etcd_security import GROUP as ETCD_GROUP
from cluster.etcd_security import EtcdTlsFiles, read_password
from engine.checks import FieldError, check_fields
from engine.flags import option

ROOT_PASSWORD_ENV = "PDSERVE_ETCD_ROOT_PASSWORD"
WORKER_PASSWORD_ENV = "PDSERVE_ETCD_WORKER_PASSWORD"
ROUTER_PASSWORD_ENV = "PDSERVE_ETCD_ROUTER_PASSWORD"
PASSWORDS_GROUP = "passwords (a file's first line, else the variable; never a flag)"


@dataclass(frozen=True)
class EtcdUsersConfig:
    etcd: str = option(metavar="HOST:PORT")
    """The etcd to set up (one member's client endpoint; the users reach every member)."""
    cluster: str = "default"
    """Cluster name: the worker and router users get the keys under /pdserve/<cluster>/, as
    the workers' and router's --cluster."""
    root_password_file: str | None = option(None, group=PASSWORDS_GROUP, metavar="PATH")
    """root's password (else PDSERVE_ETCD_ROOT_PASSWORD). Auth off: root is created with it.
    Auth on: the command signs in as root with it, and stops if etcd refuses it."""
    worker_password_file: str | None = option(None, group=PASSWORDS_GROUP, metavar="PATH")
    """The worker user's password (else PDSERVE_ETCD_WORKER_PASSWORD): what the workers get
    as --etcd-password-file or PDSERVE_ETCD_PASSWORD."""
    router_password_file: str | None = option(None, group=PASSWORDS_GROUP, metavar="PATH")
    """The router user's password (else PDSERVE_ETCD_ROUTER_PASSWORD): what the router,
    `pdserve status` and the planner get."""
    worker_user: str = WORKER_USER
    """Name of the workers' user and of its role (read and write under the cluster's keys).
    Give each cluster its own pair when several share one etcd: the command makes these users
    exactly as planned and revokes any other permission of their roles."""
    router_user: str = ROUTER_USER
    """Name of the router's user and of its role (read only under the cluster's keys)."""
    timeout: float = 10.0
    """Seconds each etcd call may take."""
    tls: EtcdTlsFiles = option(default_factory=EtcdTlsFiles, group=ETCD_GROUP)
    """How to reach an etcd that serves TLS (as every pdserve process does)."""

    def __post_init__(self) -> None:
        try:
            parse_endpoint(self.etcd)
        except ValueError as exc:
            raise FieldError("etcd", str(exc)) from None
        check_fields(
            self,
            [
                (
                    bool(self.cluster.strip()) and "/" not in self.cluster,
                    "cluster",
                    "must be a name without '/'",
                ),
                (bool(self.worker_user.strip()), "worker_user", "must not be empty"),
                (bool(self.router_user.strip()), "router_user", "must not be empty"),
                (
                    len({ROOT, self.worker_user, self.router_user}) == 3,
                    "router_user",
                    f"must differ from {ROOT} and worker_user",
                ),
                (self.timeout > 0, "timeout", "must be > 0"),
            ],
        )

    @property
    def prefix(self) -> bytes:
        return f"/pdserve/{self.cluster}/".encode()

    def plan(self, environ: Mapping[str, str] = os.environ) -> EtcdAuth:
        """root, the worker user and the router user with the passwords read now. Raises
        ValueError naming the flag and the variable of a password that is not given, or the
        flag of a file that is unreadable or empty."""
        root, worker, router = (
            _password(flag, path, env, environ)
            for flag, path, env in (
                ("--root-password-file", self.root_password_file, ROOT_PASSWORD_ENV),
                ("--worker-password-file", self.worker_password_file, WORKER_PASSWORD_ENV),
                ("--router-password-file", self.router_password_file, ROUTER_PASSWORD_ENV),
            )
        )
        return EtcdAuth(
            root,
            (
                EtcdUser(self.worker_user, worker, self.prefix, write=True),
                EtcdUser(self.router_user, router, self.prefix, write=False),
            ),
        )


def _password(flag: str, path: str | None, env: str, environ: Mapping[str, str]) -> str:
    password = read_password(flag, path, env, environ)
    if password is None:
        raise ValueError(f"no password: give {flag} or set {env}")
    return password
