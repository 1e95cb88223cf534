"""--allowed-hosts entries (router/config.py) and the `host[:port]` reading that
router/http/host_check.py shares with them. Stdlib only: the router's config imports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostRule:
    """One allowed host: a lower-case name or IP (IPv6 without brackets), and a port or None
    (any port)."""

    host: str
    port: int | None = None

    def __str__(self) -> str:  # the flag's text back (engine.flags.to_argv)
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def split_authority(value: str) -> tuple[str, int | None] | None:
    """`host[:port]` (a Host header, an --allowed-hosts entry, an Origin's authority) as
    (lower-case host, port or None); IPv6 in brackets comes back without them. None when it
    is not an authority (empty, a bad port, stray characters)."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text_ = value.rpartition(":")
        if not sep:
            host, port_text = value, None
        else:
            port_text = port_text_
        if ":" in host:  # a bare IPv6 literal without brackets is not an authority
            return None
    if not host or any(c in host for c in "/?#@ \t\\"):
        return None
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None
    return host, int(port_text)


def parse_allowed_host(text: str) -> HostRule:
    """An --allowed-hosts entry (`name`, `name:port`, `[v6]:port`, an IP, or `*`); ValueError
    naming what is wrong."""
    if text.strip() == "*":
        return HostRule("*")
    if "://" in text or "/" in text:
        raise ValueError(f"{text!r}: give a host name (and port), not a URL")
    parsed = split_authority(text)
    if parsed is None:
        raise ValueError(f"{text!r} is not a host name or host:port")
    return HostRule(*parsed)
