"""What UCX says about the transports it picked, read from inside the process: the protocol
tables `UCX_PROTO_INFO=y` makes an agent print (to stderr, from C), captured while that agent
lives and parsed. Used by the KV transfer self-test (selftest.py) to name the path its writes
took: `cma/memory` on one host, `tcp/<iface>` over sockets, `rc_mlx5/<dev>` with RDMA."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

_UCX_PREFIX = re.compile(r"^\[[\d.]+\] \[[^\]]*\]\s*")
"""What UCX puts before each line it logs: `[<time>] [<host>:<pid>:<thread>]`."""


def ucx_write_transports(log_text: str) -> list[str]:
    """The transports of UCX's 'remote memory write' protocols (NIXL's WRITEs) towards other
    agents, from the tables `UCX_PROTO_INFO=y` prints, in order, without repeats: e.g.
    `['cma/memory']` on one host, `['tcp/lo']` over sockets. Tables of an agent's endpoint to
    itself ('self') are skipped: a real transfer never takes them."""
    found: list[str] = []
    header = protocol = ""
    rows = False
    for raw in log_text.splitlines():
        line = _UCX_PREFIX.sub("", raw).strip()
        if not line.startswith("|"):
            continue  # a table border, or anything else
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:  # a table's title lines: endpoint, then protocol
            if "cfg#" in cells[0]:
                header, protocol, rows = cells[0], "", False
            else:
                protocol = cells[0]
        elif cells[0] == "Range":
            rows = True
        elif rows and "remote memory write" in protocol and " self " not in f" {header} ":
            if cells[-1] and cells[-1] not in found:
                found.append(cells[-1])
    return found


@contextmanager
def env_set(name: str, value: str) -> Iterator[None]:
    """The environment variable set while the block runs (an agent made in it reads it)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@contextmanager
def stderr_captured() -> Iterator[list[str]]:
    """File descriptor 2 redirected while the block runs (UCX writes there from C); yields a
    list that holds the captured text afterwards. Lines that are not UCX's are written on to
    the real stderr when the block ends."""
    out: list[str] = []
    sys.stderr.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            out.append(f.read().decode(errors="replace"))
            others = [
                line for line in out[0].splitlines(keepends=True) if not _UCX_PREFIX.match(line)
            ]
            if others:
                sys.stderr.write("".join(others))
