"""How a process authenticates to etcd: `EtcdSecurity`, the flags (a nested config of
WorkerConfig, RouterConfig and UpConfig; its TLS part, `EtcdTlsFiles`, also of `pdserve
etcd-users`), and `EtcdCredentials`, what `resolve` reads from them once at start (the
password, the TLS files' bytes) and every etcd client is made with (cluster/etcd_client.py
`make_client`). `read_password` is the one rule for a password in a file or a variable.

Torch-free and stdlib-only: the router and `pdserve --help` import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from cluster.secret_files import read_secret_file
from engine.checks import FieldError
from engine.flags import option

PASSWORD_ENV = "PDSERVE_ETCD_PASSWORD"
GROUP = "etcd security (docs/security.md)"


@dataclass(frozen=True)
class EtcdTls:
    """TLS material, read: the CA that signs etcd's certificate (None: the system's trusted
    roots), and this client's own certificate and key (both or neither)."""

    ca: bytes | None
    cert: bytes | None = None
    key: bytes | None = None


@dataclass(frozen=True)
class EtcdCredentials:
    """What an etcd client is made with; the default is anonymous over plain gRPC."""

    user: str | None = None
    password: str | None = None
    tls: EtcdTls | None = None

    def __repr__(self) -> str:  # never the password, in a log or a traceback
        return f"EtcdCredentials(user={self.user!r}, tls={self.tls is not None})"


@dataclass(frozen=True, kw_only=True)
class EtcdTlsFiles:
    """etcd's TLS files (etcdctl's --cacert, --cert, --key): the flags of every process that
    talks to etcd, `pdserve etcd-users` too. Keyword-only, so that `EtcdSecurity`'s user and
    password file stay its first positional fields."""

    etcd_ca: str | None = option(None, group=GROUP, metavar="PATH")
    """CA certificate (PEM) that etcd's server certificate must chain to: talk to etcd over
    TLS, the endpoint's host checked against the certificate. Default: plain gRPC, or TLS
    against the system's trusted roots for an `https://` --etcd endpoint."""
    etcd_cert: str | None = option(None, group=GROUP, metavar="PATH")
    """Client certificate (PEM) presented to etcd (etcd's --client-cert-auth); needs
    --etcd-key and --etcd-ca."""
    etcd_key: str | None = option(None, group=GROUP, metavar="PATH")
    """Private key (PEM) of --etcd-cert."""

    def __post_init__(self) -> None:
        for name in ("etcd_ca", "etcd_cert", "etcd_key"):
            _not_blank(self, name)
        if (self.etcd_cert is None) != (self.etcd_key is None):
            given, missing = (
                ("etcd_cert", "--etcd-key")
                if self.etcd_key is None
                else ("etcd_key", "--etcd-cert")
            )
            raise FieldError(
                given, f"{given} needs {missing} (a client certificate and its key go together)"
            )
        if self.etcd_cert and not self.etcd_ca:
            raise FieldError(
                "etcd_cert",
                "etcd_cert needs --etcd-ca (the CA that etcd's own certificate is checked against)",
            )

    def read_tls(self) -> EtcdTls | None:
        """The TLS files' bytes (None: plain gRPC). Raises ValueError naming the flag of a
        file that is unreadable or empty."""
        if not self.etcd_ca:
            return None
        return EtcdTls(
            _read("--etcd-ca", self.etcd_ca),
            _read("--etcd-cert", self.etcd_cert) if self.etcd_cert else None,
            _read("--etcd-key", self.etcd_key) if self.etcd_key else None,
        )


@dataclass(frozen=True)
class EtcdSecurity(EtcdTlsFiles):
    """etcd's user and TLS (etcdctl's --user, --cacert, --cert, --key)."""

    etcd_user: str | None = option(None, group=GROUP, metavar="NAME")
    """etcd user to authenticate as (needs --etcd-password-file or PDSERVE_ETCD_PASSWORD).
    Default: none; an etcd with auth enabled then refuses every request."""
    etcd_password_file: str | None = option(None, group=GROUP, metavar="PATH")
    """File whose first line is the --etcd-user's password (else PDSERVE_ETCD_PASSWORD;
    never a flag: it would show in `ps`)."""

    def __post_init__(self) -> None:
        for name in ("etcd_user", "etcd_password_file"):
            _not_blank(self, name)
        super().__post_init__()
        if self.etcd_password_file and not self.etcd_user:
            raise FieldError(
                "etcd_password_file",
                "etcd_password_file needs --etcd-user (whose password it holds)",
            )

    def resolve(self, environ: Mapping[str, str] = os.environ) -> EtcdCredentials:
        """Read the password and the TLS files, once, at start. Raises ValueError naming the
        flag (or PDSERVE_ETCD_PASSWORD) of anything missing, unreadable or empty."""
        password = None
        if self.etcd_user:
            password = read_password(
                "--etcd-password-file", self.etcd_password_file, PASSWORD_ENV, environ
            )
            if password is None:
                raise ValueError(
                    f"--etcd-user {self.etcd_user} needs its password: "
                    f"--etcd-password-file or {PASSWORD_ENV}"
                )
        elif environ.get(PASSWORD_ENV):
            raise ValueError(
                f"{PASSWORD_ENV} is set but --etcd-user is not: say whose password it is"
            )
        return EtcdCredentials(self.etcd_user, password, self.read_tls())


def read_password(flag: str, path: str | None, env: str, environ: Mapping[str, str]) -> str | None:
    """A password from the file `path` (given as `flag`), else from the variable `env`; None
    when neither is given. Either way the password is the first line, without the white space
    around it (a Kubernetes Secret made from a file keeps the file's newline). Raises
    ValueError naming the flag or variable when that line is empty or the file unreadable."""
    if path is not None:
        source, text = f"{flag} {path}", _read(flag, path).decode()
    elif environ.get(env):
        source, text = env, environ[env]
    else:
        return None
    password = text.splitlines()[0].strip() if text.strip() else ""
    if not password:
        raise ValueError(f"{source}: the first line is empty")
    return password


def _not_blank(config: object, name: str) -> None:
    value = getattr(config, name)
    if value is not None and not value.strip():
        raise FieldError(name, f"{name} must not be empty")


def _read(flag: str, path: str) -> bytes:
    return read_secret_file(f"{flag} {path}", path)
