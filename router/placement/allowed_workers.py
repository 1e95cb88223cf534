"""Which registrations the router trusts by address (`--allowed-worker-cidrs`): a worker whose
gRPC or metrics address lies outside the allowed networks gets no prompts, and the dashboard
never fetches its /metrics (it reads only the registry's workers).

Hostnames: accepted only when every address is allowed (the default). With a narrower list
a registration naming a host by name is refused, not resolved: the name could resolve to
another address by the time the router connects (DNS rebinding), so a check at registration
would not bind where the prompts go. Workers behind such a list advertise IP addresses
(`--advertise-host`).
"""

from __future__ import annotations

import argparse
import ipaddress
from typing import Union

from cluster.registration import WorkerInfo

IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
ANY: tuple[IPNetwork, ...] = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
LOOPBACK: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("127.0.0.0/8"),
    ipaddress.ip_network("::1/128"),
)


def parse_network(text: str) -> IPNetwork:
    """`--allowed-worker-cidrs` item: a network (10.0.0.0/8, fd00::/8) or one address."""
    try:
        return ipaddress.ip_network(text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a network in CIDR form (e.g. 10.0.0.0/8, ::1/128): {exc}"
        ) from None


def split_host(address: str) -> str:
    """The host of `host:port` (`[v6]:port` too)."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host.removeprefix("[").removesuffix("]")


class AllowedWorkers:
    """`refusal(info)`: why a registration is not trusted (None: it is)."""

    def __init__(self, networks: tuple[IPNetwork, ...]) -> None:
        self.networks = networks
        self.any = all(any(n.prefixlen == 0 and n.version == v for n in networks) for v in (4, 6))

    def refusal(self, info: WorkerInfo) -> str | None:
        if self.any:
            return None
        for what, address in (("gRPC", info.grpc_address), ("metrics", info.metrics_address)):
            if not address and what == "metrics":
                continue
            host = split_host(address)
            try:
                ip = ipaddress.ip_address(host)
            except ValueError:
                return (
                    f"its {what} address {address!r} names a host, not an IP address "
                    "(refused: --allowed-worker-cidrs checks IP addresses)"
                )
            if ip.version == 6 and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped  # ::ffff:10.0.0.1 is 10.0.0.1
            if not any(ip in n for n in self.networks):
                return (
                    f"its {what} address {address} is outside --allowed-worker-cidrs "
                    f"({' '.join(map(str, self.networks))})"
                )
        return None
