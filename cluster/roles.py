"""The names every process of a cluster agrees on, defined once: the role a worker serves
and the path a prompt's prefill took. Plain `StrEnum`s (no imports): they travel as their
string values in etcd, gRPC and /metrics, and the router imports them without the engine."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """The role a worker serves (published in its registration; `Worker.SetRole` moves it)."""

    PREFILL = "prefill"
    DECODE = "decode"


ROLES: tuple[str, ...] = tuple(Role)
"""The roles' string values, in declaration order (flag choices, etcd key checks)."""


class PrefillPath(enum.StrEnum):
    """Where a request's prompt was computed (`GenerateResponse.prefill_mode`, a /metrics
    label, the router's placement plan)."""

    LOCAL = "local"
    """On the decode worker itself (no prefill worker named, or it could not be used)."""
    LOCAL_FALLBACK = "local_fallback"
    """On the decode worker, after the named prefill worker failed."""
    REMOTE = "remote"
    """On a prefill worker; the KV was pushed into the decode worker's blocks."""
