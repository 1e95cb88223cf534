"""Plain counters and histograms for KV transfer, per peer; the workers export them.

No Prometheus import here: a worker's /metrics handler reads `TransferMetrics.snapshot()` (or
the objects directly) and maps them onto its own collectors.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

#: Upper bounds (seconds) of the latency buckets; the last bucket is +Inf.
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


@dataclass(slots=True)
class Histogram:
    """Cumulative-style histogram data: counts per bucket (non-cumulative), sum and count."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def to_dict(self) -> dict[str, object]:
        return {"bounds": list(self.bounds), "counts": list(self.counts),
                "sum": self.sum, "count": self.count}


@dataclass(slots=True)
class PeerMetrics:
    """What moved between us and one peer, in one direction."""

    bytes: int = 0
    """Payload bytes of batches that completed (sender) or whose notification arrived."""
    blocks: int = 0
    batches: int = 0
    requests_completed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """Failed requests by reason: 'timeout', 'cancelled', 'error'."""
    request_latency_s: Histogram = field(default_factory=Histogram)
    """First batch (sender) or expect() (receiver) until completion, completed requests only."""
    batch_latency_s: Histogram = field(default_factory=Histogram)
    """Post until done of one batch write (sender only)."""

    def to_dict(self) -> dict[str, object]:
        return {
            "bytes": self.bytes, "blocks": self.blocks, "batches": self.batches,
            "requests_completed": self.requests_completed, "failures": dict(self.failures),
            "request_latency_s": self.request_latency_s.to_dict(),
            "batch_latency_s": self.batch_latency_s.to_dict(),
        }


@dataclass(slots=True)
class TransferMetrics:
    """Metrics of one sender or one receiver, keyed by peer agent name."""

    direction: str
    """'send' or 'recv'."""
    peers: dict[str, PeerMetrics] = field(default_factory=dict)
    dropped_notifications: int = 0
    """Notifications that matched no pending request (late, after a timeout/cancel) or were
    malformed; dropped without effect."""

    def peer(self, name: str) -> PeerMetrics:
        m = self.peers.get(name)
        if m is None:
            m = self.peers[name] = PeerMetrics()
        return m

    def record_batch(self, peer: str, blocks: int, nbytes: int, latency_s: float | None) -> None:
        m = self.peer(peer)
        m.batches += 1
        m.blocks += blocks
        m.bytes += nbytes
        if latency_s is not None:
            m.batch_latency_s.observe(latency_s)

    def record_completed(self, peer: str, latency_s: float) -> None:
        m = self.peer(peer)
        m.requests_completed += 1
        m.request_latency_s.observe(latency_s)

    def record_failure(self, peer: str, reason: str) -> None:
        m = self.peer(peer)
        m.failures[reason] = m.failures.get(reason, 0) + 1

    def snapshot(self) -> dict[str, object]:
        return {
            "direction": self.direction,
            "dropped_notifications": self.dropped_notifications,
            "peers": {name: m.to_dict() for name, m in self.peers.items()},
        }
