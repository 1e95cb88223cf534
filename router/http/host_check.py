"""Which `Host` and `Origin` headers the router answers (against DNS rebinding and cross-origin
browser requests), checked by router/http/middleware.py before the key check.

DNS rebinding: a web page on a domain the attacker controls makes its name resolve to
127.0.0.1; the victim's browser then sends the page's requests to a router on loopback, as
same-origin requests carrying `Host: attacker.example`. A router without an API key would
serve them (the model, and with --enable-sleep-mode / --enable-lora the admin surface).

The rules (docs/security.md, "The HTTP edge"):
- **Host**, only when the router has no inference API key (a key protects it otherwise; an
  admin key alone leaves /v1/* open, so it does not count): the name must be one it serves
  on — the listen address (--host), `localhost`, `127.0.0.1`, `[::1]` — or an --allowed-hosts
  entry, with or without a port (an entry with a port matches that port
  only). On a wildcard listen address (0.0.0.0, ::) any IP literal is served too (a rebinding
  page always sends a name). `--allowed-hosts '*'` turns the check off. A request without a
  Host header (HTTP/1.0; no browser sends one) passes. Else 421 `host_not_allowed`.
- **Origin**, always: a browser request from another origin (an `Origin` header that names
  neither the request's own host, nor an allowed host as above) is a 403
  `origin_not_allowed`; so is `Origin: null` (sandboxed frames, files). No CORS header is
  ever sent, so a browser page of another origin cannot read answers either way.
"""

from __future__ import annotations

import ipaddress
from typing import Iterable

from router.http.allowed_hosts import HostRule, split_authority
from router.http.errors import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD = frozenset({"0.0.0.0", "::"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class HostCheck:
    """The Host / Origin rules of one router (module docstring). `check` runs on every HTTP
    request: one pass over the headers, set lookups, no allocation when both headers pass."""

    def __init__(self, listen_host: str, allowed: Iterable[HostRule], keyed: bool) -> None:
        rules = list(allowed)
        self.any_host = any(r.host == "*" for r in rules)
        listen = listen_host.strip("[]").lower()
        self.wildcard = listen in WILDCARD
        self.names = frozenset(
            {*LOOPBACK_NAMES, *(() if self.wildcard else (listen,))}
            | {r.host for r in rules if r.port is None and r.host != "*"}
        )
        """Hosts served on any port."""
        self.host_ports = frozenset((r.host, r.port) for r in rules if r.port is not None)
        """Hosts served on one port."""
        self.check_host = not keyed and not self.any_host
        """Without a key the Host header is checked; with one, the key protects the router."""

    def allowed(self, host: str, port: int | None) -> bool:
        """Whether `host[:port]` is a name this router serves on (module docstring)."""
        return (
            self.any_host
            or host in self.names
            or (host, port) in self.host_ports
            or (self.wildcard and _is_ip(host))
        )

    def check(self, scope: dict) -> APIError | None:
        """The 421 / 403 for this request, or None."""
        host_value = origin = None
        for name, value in scope.get("headers", ()):
            if name == b"host":
                host_value = value
            elif name == b"origin":
                origin = value
        host = None
        if host_value is not None:
            host = split_authority(host_value.decode("latin-1"))
            if self.check_host and (host is None or not self.allowed(*host)):
                return APIError(
                    421,
                    "This router does not serve the host name this request was sent to "
                    "(a DNS-rebinding guard: without an API key the router answers only to "
                    "the names it listens on; add the name with --allowed-hosts).",
                    code="host_not_allowed",
                )
        if origin is not None and not self._same_or_allowed(origin, host):
            return APIError(
                403,
                "Cross-origin browser requests are refused: the Origin header names "
                "neither this router nor a host of --allowed-hosts.",
                code="origin_not_allowed",
            )
        return None

    def _same_or_allowed(self, origin: bytes, host: tuple[str, int | None] | None) -> bool:
        scheme, sep, authority = origin.decode("latin-1").strip().lower().partition("://")
        parsed = split_authority(authority) if sep and "/" not in authority else None
        if parsed is None:  # `null`, or not an origin at all
            return False
        o_host, o_port = parsed
        if host is not None and o_host == host[0]:
            # The same host: a same-origin request (ports are not compared: behind a proxy
            # that ends TLS the router cannot know the port the browser used).
            return True
        return o_host in self.names or (o_host, o_port or _DEFAULT_PORTS.get(scheme)) in (
            self.host_ports
        )
