"""KV transfer counters and latency histograms, per peer, kept in prometheus_client collectors.

Each sender and each receiver owns a `TransferMetrics` with its own `CollectorRegistry` (one
process may hold several backends, e.g. in tests). A worker exports one by registering that
registry in its own (`CollectorRegistry.register(metrics.registry)`); `peers` and `snapshot()`
read the same collectors back as plain values.

A sender also keeps vLLM's NIXL connector histograms, under vLLM's names and without labels
(one sender per worker): `vllm:nixl_num_descriptors` and `vllm:nixl_bytes_transferred` per
transfer posted (a batch; this rank's part of it on a tensor-parallel worker), and
`vllm:nixl_post_time_seconds` (building and posting it) and `vllm:nixl_xfer_time_seconds`
(post until done). The descriptors of a transfer are its runs of adjacent blocks
(kvtransfer/coalesce.py), or its (block, row) pieces between pools of other head splits.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client import Histogram as PromHistogram
from prometheus_client.samples import Sample

#: Upper bounds (seconds) of the latency buckets; the last bucket is +Inf.
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

#: Upper bounds of the descriptors-per-transfer buckets (a run of adjacent blocks is one).
DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384, 65536)
#: Upper bounds (bytes) of the bytes-per-transfer buckets: 64 KiB to 4 GiB.
BYTES_BUCKETS = tuple(float(1 << s) for s in range(16, 33, 2))

_PREFIX = "pdserve_kv_transfer_"
NIXL_LABELS = ("model_name", "engine", "role")
"""The vllm:nixl_* histograms' labels, as vLLM's engine metrics (worker_runtime/metrics.py)."""
_LABELS = ("direction", "peer")


@dataclass(frozen=True, slots=True)
class Histogram:
    """A latency histogram as read from its collector: counts per bucket (not cumulative; the
    last is +Inf), sum and count."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: tuple[int, ...] = (0,) * (len(LATENCY_BUCKETS_S) + 1)
    sum: float = 0.0
    count: int = 0


@dataclass(frozen=True, slots=True)
class PeerMetrics:
    """What moved between us and one peer, in one direction, when it was read."""

    bytes: int = 0
    """Payload bytes of batches that completed (sender) or whose notification arrived."""
    blocks: int = 0
    batches: int = 0
    requests_completed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    """Failed requests by reason: 'timeout', 'cancelled', 'error'."""
    request_latency_s: Histogram = Histogram()
    """First batch (sender) or expect() (receiver) until completion, completed requests only."""
    batch_latency_s: Histogram = Histogram()
    """Post until done of one batch write (sender only)."""


@dataclass(frozen=True, slots=True)
class TransferSizes:
    """The NIXL transfers a sender posted, as read from its histograms."""

    transfers: int = 0
    descriptors: int = 0
    """Summed over the transfers (one per coalesced region)."""
    bytes: int = 0


class TransferMetrics:
    """Metrics of one sender or one receiver, labelled by direction and peer agent name.

    Exported names: pdserve_kv_transfer_{bytes,blocks,batches,requests}_total and
    _failures_total{reason} (counters), _latency_seconds and _batch_latency_seconds
    (histograms), _dropped_notifications_total (direction only); a sender also
    vllm:nixl_{num_descriptors,bytes_transferred,post_time_seconds,xfer_time_seconds}
    (histograms, module docstring).
    """

    def __init__(self, direction: str) -> None:
        self.direction = direction
        self.vllm_labels: tuple[str, str, str] = ("", "0", "")
        """(model_name, engine, role) of the vllm:nixl_* samples (`label_vllm`)."""
        """'send' or 'receive'."""
        self.registry = CollectorRegistry()

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(_PREFIX + name, doc, labels or _LABELS, registry=self.registry)

        def histogram(name: str, doc: str) -> PromHistogram:
            return PromHistogram(
                _PREFIX + name, doc, _LABELS, registry=self.registry, buckets=LATENCY_BUCKETS_S
            )

        self._counters = {
            "bytes": counter(
                "bytes", "KV payload bytes of completed (send) or notified (receive) batches"
            ),
            "blocks": counter("blocks", "KV blocks moved"),
            "batches": counter("batches", "KV batch writes moved"),
            "requests_completed": counter("requests", "KV transfers completed"),
        }
        self._failures = counter("failures", "KV transfers failed, by reason", *_LABELS, "reason")
        self._histograms = {
            "request_latency_s": histogram(
                "latency_seconds",
                "First batch (send) or expect() (receive) until a KV transfer completed",
            ),
            "batch_latency_s": histogram(
                "batch_latency_seconds", "Post until done of one KV batch write (send only)"
            ),
        }
        self._nixl = (
            {
                "descriptors": PromHistogram(
                    "vllm:nixl_num_descriptors",
                    "Histogram of number of descriptors per NIXL KV Cache transfers.",
                    NIXL_LABELS,
                    registry=self.registry,
                    buckets=DESCRIPTOR_BUCKETS,
                ),
                "bytes": PromHistogram(
                    "vllm:nixl_bytes_transferred",
                    "Histogram of bytes transferred per NIXL KV Cache transfers.",
                    NIXL_LABELS,
                    registry=self.registry,
                    buckets=BYTES_BUCKETS,
                ),
                "post_s": PromHistogram(
                    "vllm:nixl_post_time_seconds",
                    "Histogram of transfer post time for NIXL KV Cache transfers.",
                    NIXL_LABELS,
                    registry=self.registry,
                    buckets=LATENCY_BUCKETS_S,
                ),
                "xfer_s": PromHistogram(
                    "vllm:nixl_xfer_time_seconds",
                    "Histogram of transfer duration for NIXL KV Cache transfers.",
                    NIXL_LABELS,
                    registry=self.registry,
                    buckets=LATENCY_BUCKETS_S,
                ),
            }
            if direction == "send"
            else {}
        )
        self._dropped = counter(
            "dropped_notifications",
            "KV notifications that matched no pending request "
            "(late, after a timeout/cancel) or were malformed",
            "direction",
        ).labels(direction)

    def label_vllm(self, model_name: str, role: str) -> None:
        """The worker's model and role, for the vllm:nixl_* samples from now on."""
        self.vllm_labels = (model_name, "0", role)

    # -- recording (under the owning backend's lock) -----------------------------------
    def record_batch(self, peer: str, blocks: int, nbytes: int, latency_s: float | None) -> None:
        self._counters["batches"].labels(self.direction, peer).inc()
        self._counters["blocks"].labels(self.direction, peer).inc(blocks)
        self._counters["bytes"].labels(self.direction, peer).inc(nbytes)
        if latency_s is not None:
            self._histograms["batch_latency_s"].labels(self.direction, peer).observe(latency_s)
            if self._nixl:
                self._nixl["xfer_s"].labels(*self.vllm_labels).observe(latency_s)

    def record_post(self, descriptors: int, nbytes: int, post_s: float) -> None:
        """A NIXL transfer posted by the sender: its descriptors (coalesced regions), bytes
        and the seconds building and posting it took."""
        if self._nixl:
            self._nixl["descriptors"].labels(*self.vllm_labels).observe(descriptors)
            self._nixl["bytes"].labels(*self.vllm_labels).observe(nbytes)
            self._nixl["post_s"].labels(*self.vllm_labels).observe(post_s)

    def record_completed(self, peer: str, latency_s: float) -> None:
        self._counters["requests_completed"].labels(self.direction, peer).inc()
        self._histograms["request_latency_s"].labels(self.direction, peer).observe(latency_s)

    def record_failure(self, peer: str, reason: str) -> None:
        self._failures.labels(self.direction, peer, reason).inc()

    def record_dropped(self) -> None:
        """A notification dropped without effect (see `dropped_notifications`)."""
        self._dropped.inc()

    # -- reading -------------------------------------------------------------------------
    @property
    def transfers(self) -> TransferSizes:
        """The NIXL transfers posted so far (sender only; zeros otherwise)."""
        if not self._nixl:
            return TransferSizes()

        def total(name: str, suffix: str) -> float:  # over every label set (role changes)
            return sum(
                s.value
                for family in self.registry.collect()
                for s in family.samples
                if s.name == name + suffix
            )

        return TransferSizes(
            int(total("vllm:nixl_num_descriptors", "_count")),
            int(total("vllm:nixl_num_descriptors", "_sum")),
            int(total("vllm:nixl_bytes_transferred", "_sum")),
        )

    @property
    def dropped_notifications(self) -> int:
        value = self.registry.get_sample_value(
            _PREFIX + "dropped_notifications_total", {"direction": self.direction}
        )
        assert value is not None  # its child is made in __init__
        return int(value)

    @property
    def peers(self) -> dict[str, PeerMetrics]:
        """Per peer agent name, the values now; a peer appears with its first event."""
        rows: defaultdict[str, dict] = defaultdict(lambda: {"failures": {}})
        for name, metric in self._counters.items():
            for s in _samples(metric, "_total"):
                rows[s.labels["peer"]][name] = int(s.value)
        for s in _samples(self._failures, "_total"):
            rows[s.labels["peer"]]["failures"][s.labels["reason"]] = int(s.value)
        for name, histogram in self._histograms.items():
            cumulative: defaultdict[str, list[int]] = defaultdict(list)
            for s in _samples(histogram, "_bucket"):  # in bound order, +Inf last
                cumulative[s.labels["peer"]].append(int(s.value))
            totals = {s.labels["peer"]: s.value for s in _samples(histogram, "_sum")}
            for peer, cum in cumulative.items():
                counts = tuple(b - a for a, b in zip([0, *cum], cum))
                rows[peer][name] = Histogram(counts=counts, sum=totals[peer], count=cum[-1])
        return {peer: PeerMetrics(**row) for peer, row in rows.items()}

    def snapshot(self) -> dict[str, object]:
        return {
            "direction": self.direction,
            "dropped_notifications": self.dropped_notifications,
            "peers": {name: asdict(m) for name, m in self.peers.items()},
        }


def _samples(metric: Counter | PromHistogram, suffix: str) -> Iterator[Sample]:
    for family in metric.collect():
        yield from (s for s in family.samples if s.name.endswith(suffix))
