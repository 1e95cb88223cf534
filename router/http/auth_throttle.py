"""Back-off for clients that keep presenting wrong API keys (router/http/middleware.py asks it
before the key check and tells it each 401).

A client address with MAX_FAILURES wrong keys in a row — each within WINDOW_S of the previous
one — is refused with a 429 (`too_many_failed_authentications`, `Retry-After`) for 1 s, then
for twice as long after each further wrong key, up to MAX_BACKOFF_S; while refused, no key of
its is looked at. A right key, or WINDOW_S without a wrong one, clears the address. IPv6
clients count per /64 (one host usually holds a whole /64). The table keeps at most
MAX_CLIENTS addresses (least recently failed first out), so an attacker with many addresses
costs bounded memory and only makes its own entries fall out.

Clients behind one proxy share its address (unless the proxy is trusted to forward theirs:
uvicorn's --forwarded-allow-ips, 127.0.0.1 by default), so one of them guessing keys slows
the others' requests down too, for at most MAX_BACKOFF_S at a time.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from router.http.errors import APIError

MAX_FAILURES = 10
WINDOW_S = 300.0
BASE_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
MAX_CLIENTS = 8192


@dataclass(slots=True)
class _Client:
    failures: int
    last_failure: float
    blocked_until: float


def client_of(scope: dict) -> str:
    """The address a request is counted under: its client's IP (an IPv6 one as its /64)."""
    client = scope.get("client")
    if not client:
        return "-"
    host = client[0]
    if ":" not in host:  # IPv4 (or a unix socket's name)
        return host
    try:
        ip = ipaddress.IPv6Address(host)
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))


class FailedAuthThrottle:
    """Per client address: wrong keys counted, back-off computed (module docstring). Not
    thread-safe: the router's event loop is its only user."""

    def __init__(
        self,
        max_failures: int = MAX_FAILURES,
        window_s: float = WINDOW_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_backoff_s = max_backoff_s
        self.max_clients = max_clients
        self.clock = clock
        self._clients: OrderedDict[str, _Client] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def refused(self, client: str) -> APIError | None:
        """The 429 for a request from `client` while it is backing off, else None."""
        entry = self._clients.get(client)
        if entry is None:
            return None
        wait = entry.blocked_until - self.clock()
        if wait <= 0:
            return None
        return APIError(
            429,
            "Too many requests with a wrong API key from this address; retry later.",
            code="too_many_failed_authentications",
            headers={"Retry-After": str(max(1, math.ceil(wait)))},
        )

    def failed(self, client: str) -> None:
        """`client` presented a wrong key (a 401)."""
        now = self.clock()
        entry = self._clients.pop(client, None)
        if entry is None or now - entry.last_failure > self.window_s:
            entry = _Client(0, now, 0.0)
        entry.failures += 1
        entry.last_failure = now
        over = entry.failures - self.max_failures
        if over >= 0:
            entry.blocked_until = now + min(self.max_backoff_s, BASE_BACKOFF_S * 2 ** min(over, 32))
        self._clients[client] = entry  # the most recent failure last
        while len(self._clients) > self.max_clients:
            self._clients.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """`client` presented a right key: its count starts over."""
        if self._clients:
            self._clients.pop(client, None)
