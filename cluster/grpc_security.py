"""Who may call a worker's gRPC port: the cluster plane's authentication, the same on every
server and every channel (docs/security.md, "Workers"). This module is its configuration;
cluster/grpc_auth.py puts it on servers and channels.

Two mechanisms, either or both:
- a cluster token, one shared secret: every channel sends `authorization: Bearer <token>` on
  every call, and one server interceptor ends a call without it, or with another one, as
  UNAUTHENTICATED;
- mutual TLS: the server asks for a client certificate signed by `--tls-ca`
  (require_client_auth) and the client checks the server's against the same CA.

`GrpcSecurity` is the config (its fields are flags: `--cluster-token-file`, `--tls-cert`,
`--tls-key`, `--tls-ca`, `--tls-server-name`); `resolve` reads what it names once, at start,
into a `ClusterAuth` (the token also from PDSERVE_CLUSTER_TOKEN: never from argv, where `ps`
shows it). An empty or unreadable file, a malformed token or half-configured TLS raises
ValueError naming the flag (`pdserve` exits 2). Without either, servers stay open and
channels plain, as before: the port must then sit on a network only the cluster reaches.

Stdlib only (no grpc, no torch): every command's flags, and `pdserve --help`, import it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cluster.secret_files import read_secret_file, with_absolute_paths, write_secret_file
from engine.flags import option

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
GROUP = "cluster plane security (gRPC between router and workers; docs/security.md)"
"""The help group of `GrpcSecurity`'s flags, in every command that has them."""
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class GrpcSecurity:
    cluster_token_file: str | None = option(None, metavar="PATH")
    """File holding the cluster token (one line, at least 16 characters), shared by the router
    and every worker: each gRPC call carries it and a worker refuses a call without it
    (UNAUTHENTICATED). Not given: PDSERVE_CLUSTER_TOKEN, else no token. The token itself is
    never a flag (`ps` would show it)."""
    tls_cert: str | None = option(None, metavar="PATH")
    """PEM certificate this process presents on gRPC (as server and as client); with
    --tls-key and --tls-ca: mutual TLS on every gRPC port and channel."""
    tls_key: str | None = option(None, metavar="PATH")
    """PEM private key of --tls-cert."""
    tls_ca: str | None = option(None, metavar="PATH")
    """PEM CA bundle that peers' certificates must chain to (both directions)."""
    tls_server_name: str | None = option(None, metavar="NAME")
    """Name the workers' certificates carry, checked instead of the host dialled (workers are
    dialled by the address they register, often a pod IP). Default: the host dialled."""

    def absolute(self) -> GrpcSecurity:
        """The same files by absolute path (for a child process started elsewhere)."""
        return with_absolute_paths(self, "tls_server_name")


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of one process's mutual-TLS identity."""

    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    ca: bytes = field(repr=False)
    server_name: str | None = None


@dataclass(frozen=True)
class ClusterAuth:
    """What `resolve` read: the token and the TLS identity, each None when not configured.
    Never prints the token."""

    token: str | None = field(default=None, repr=False)
    tls: TlsMaterial | None = None
    source: str = "none"
    """Where the token came from (a flag or the variable), for logs."""

    @property
    def authenticated(self) -> bool:
        return self.token is not None or self.tls is not None

    def describe(self) -> str:
        """One line for a start log: what callers must present."""
        parts = [f"cluster token ({self.source})"] if self.token is not None else []
        if self.tls is not None:
            parts.append("mutual TLS")
        return " + ".join(parts) or "nothing (unauthenticated)"


OPEN = ClusterAuth()
"""No token, no TLS: open servers, plain channels."""


def write_token_file(path: Path) -> Path:
    """A new random cluster token in a new file `path`, readable by its owner alone (0600;
    an existing file is never overwritten). Returns `path`."""
    return write_secret_file(path, secrets.token_urlsafe(32), exclusive=True)


def resolve(config: GrpcSecurity, environ: Mapping[str, str]) -> ClusterAuth:
    """Read the token and TLS files `config` names (the token from `environ` when no file is
    given). Raises ValueError naming the flag of what is missing, unreadable or malformed."""
    token, source = None, "none"
    if config.cluster_token_file is not None:
        source = f"--cluster-token-file {config.cluster_token_file}"
        text = read_secret_file(source, config.cluster_token_file).decode("utf-8", "replace")
        token = _token(text, source)
    elif environ.get(TOKEN_ENV) is not None:
        source = TOKEN_ENV
        token = _token(environ[TOKEN_ENV], source)
    return ClusterAuth(token, _tls(config), source)


def _token(text: str, source: str) -> str:
    token = text.removesuffix("\n").removesuffix("\r")  # a file's (or Secret's) last newline
    if not token:
        raise ValueError(f"{source}: the cluster token is empty (to run without one, give none)")
    if "\n" in token:
        raise ValueError(f"{source}: the cluster token is one line; this has several")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(
            f"{source}: the cluster token must be printable ASCII without spaces "
            "(it travels as `authorization: Bearer <token>`)"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{source}: the cluster token has {len(token)} characters; use at "
            f"least {MIN_TOKEN_CHARS}, e.g. `openssl rand -hex 32`"
        )
    return token


def _tls(config: GrpcSecurity) -> TlsMaterial | None:
    files = {"--tls-cert": config.tls_cert, "--tls-key": config.tls_key, "--tls-ca": config.tls_ca}
    paths = {flag: path for flag, path in files.items() if path is not None}
    given = list(paths)
    if not given:
        if config.tls_server_name is not None:
            raise ValueError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca")
        return None
    if len(given) < len(files):
        missing = ", ".join(flag for flag in files if flag not in given)
        raise ValueError(
            f"{', '.join(given)} without {missing}: mutual TLS needs all three "
            "(this process's certificate, its key, and the CA peers chain to)"
        )
    pems = []
    for flag, path in paths.items():
        pem = read_secret_file(f"{flag} {path}", path)
        if b"-----BEGIN " not in pem:
            raise ValueError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
        pems.append(pem)
    cert, key, ca = pems
    return TlsMaterial(cert, key, ca, config.tls_server_name)
