"""KV peers (tests/kvtransfer/kv_peer.py) in a namespace, and what UCX said it used.

UCX_PROTO_INFO=y makes UCX print, per protocol it selects, a table naming the transport and
device (`tcp/<veth>`, `cma/memory`, `posix/memory`, ...); `write_transports` reads the
transports of the remote memory writes (NIXL's WRITEs are `ucp_put`) back from a log."""

from __future__ import annotations

import re
from pathlib import Path

from netns_util import Host, NetnsChild

_CONFIG = re.compile(r"\|\s*[\d.inf]+\s*\|[^|]*\|\s*(\S+/\S+)\s*\|")


def start_peer(
    host: Host,
    name: str,
    num_blocks: int,
    seed: int,
    log_dir: Path,
    default_timeout_s: float = 30.0,
) -> NetnsChild:
    """A kv_peer in `host`'s namespace, UCX on TCP over its veth only (not ready yet)."""
    env = {**host.ucx_env(), "UCX_PROTO_INFO": "y"}
    return NetnsChild(
        host,
        "netns_kv:serve_peer",
        name,
        num_blocks,
        seed,
        default_timeout_s,
        env=env,
        log_path=log_dir / f"{name}.log",
    )


def serve_peer(conn, name: str, num_blocks: int, seed: int, default_timeout_s: float) -> None:
    """Child target: kv_peer's loop, its backend's default deadline set to `default_timeout_s`
    (kv_peer's `send` takes none)."""
    import functools

    from kv_peer import MODEL, _serve

    import kvtransfer

    kvtransfer.KVTransferConfig = functools.partial(
        kvtransfer.KVTransferConfig, default_timeout_s=default_timeout_s
    )
    _serve(conn, name, num_blocks, seed, MODEL)


def write_transports(log_text: str) -> set[str]:
    """Transports/devices UCX selected for remote memory writes, e.g. {'tcp/pdab12cdp'}."""
    found: set[str] = set()
    for table in re.split(r"\n(?=.*cfg#)", log_text):
        header = table.split("\n", 3)[:3]
        if " self cfg#" in header[0]:  # an agent's writes to itself
            continue
        if any("remote memory write" in line for line in header):
            found.update(_CONFIG.findall(table))
    return found
