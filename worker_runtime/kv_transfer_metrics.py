"""A worker's KV transfer metrics, the part of its /metrics (worker_runtime/metrics.py,
`WorkerMetrics`) about moving KV blocks between workers. docs/metrics.md lists every name.

- The transfers themselves (`pdserve_kv_transfer_*`: seconds, bytes, blocks, failures, per
  peer; vLLM's `vllm:nixl_*` descriptors, bytes and times) live in the KV sender's and
  receiver's own registries (kvtransfer/metrics.py); they are exported as they are, and the
  `vllm:nixl_*` histograms carry the engine metrics' labels (model name, engine, role, which
  follows a role switch).
- The decode worker's handover (`pdserve_worker_kv_handover_seconds`): from a remote
  prefill's last KV write landing (the prefill worker's post returning) to its first token
  handed to the stream here; and the prefill worker's part of it, as its answer reports it
  (`pdserve_worker_kv_handover_prefill_seconds`).
- Pulls of prompt blocks from peers (worker_runtime/kv_pull.py) and sends to pulling peers
  (worker_runtime/kv_export.py), whatever the role.
- The KV transfer self-test at start (`pdserve_kv_transfer_selftest_*` gauges,
  worker_runtime/process.py): 0 until it ran, and when it failed or was skipped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from cluster.registration import TransferSelftest

#: The handover's targets are p50 <= 5 ms and p99 <= 20 ms (issue 58): finer below 50 ms.
HANDOVER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)


class KVTransferMetrics:
    """The KV transfer metrics, registered in a worker's `registry`. `WorkerMetrics` holds one
    and gives its counters and histograms to the workers under the same names
    (`metrics.kv_handover`, `metrics.kv_pulls`, ...)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        kv_backend,
        model_name: str,
        role: str,
        pull_buckets: tuple[float, ...],
    ) -> None:
        """`pull_buckets`: the bounds of `kv_pull_seconds` (the worker's latency buckets)."""
        self.kv = kv_backend
        self.model_name = model_name
        self._selftest: TransferSelftest | None = None
        # Bytes, blocks, batches, requests, failures, latency histograms: each side's own
        # registry (kvtransfer.metrics), exported here as they are.
        registry.register(kv_backend.sender.metrics.registry)
        registry.register(kv_backend.receiver.metrics.registry)
        kv_backend.sender.metrics.label_vllm(model_name, role)
        # KV pulled from peers (kv_pull.py) and sent to them (kv_export.py), whatever the role.
        self.kv_pulls = Counter(
            "pdserve_worker_kv_pulls",
            "Pulls of prompt blocks from a peer "
            "the router named, by outcome (pulled; failed: computed "
            "instead; skipped: nothing to pull or no room)",
            ["outcome"],
            registry=registry,
        )
        self.kv_pull_blocks = Counter(
            "pdserve_worker_kv_pull_blocks",
            "Blocks pulled from peers into the prefix cache",
            registry=registry,
        )
        self.kv_pull_seconds = Histogram(
            "pdserve_worker_kv_pull_seconds",
            "Time of a completed pull, call to adoption",
            registry=registry,
            buckets=pull_buckets,
        )
        self.kv_handover = Histogram(
            "pdserve_worker_kv_handover_seconds",
            "Decode worker: from a remote prefill's last KV write landing (the prefill worker's "
            "post returning) to its first token handed to the Generate stream here "
            "(docs/kvtransfer.md, the split path's critical path)",
            registry=registry,
            buckets=HANDOVER_BUCKETS,
        )
        self.kv_handover_prefill = Histogram(
            "pdserve_worker_kv_handover_prefill_seconds",
            "Decode worker: the prefill worker's part of the handover, as its answer reports "
            "it (its last write's post returning -> its answer sent)",
            registry=registry,
            buckets=HANDOVER_BUCKETS,
        )
        self.kv_exports = Counter(
            "pdserve_worker_kv_exports",
            "Block sends to a pulling peer, "
            "by outcome (sent; missing: a block no longer held here; "
            "failed)",
            ["outcome"],
            registry=registry,
        )
        self.kv_export_blocks = Counter(
            "pdserve_worker_kv_export_blocks",
            "Blocks sent to pulling peers",
            registry=registry,
        )

    def set_role(self, role: str) -> None:
        """The worker serves `role` now: the `vllm:nixl_*` series continue under it."""
        self.kv.sender.metrics.label_vllm(self.model_name, role)

    def set_selftest(self, result: TransferSelftest) -> None:
        """The KV transfer self-test at start (worker_runtime/process.py)."""
        self._selftest = result

    def collect_selftest(self) -> Iterator[GaugeMetricFamily]:
        """The self-test's gauges; 0 until it ran, and when it failed or was skipped."""
        t = self._selftest
        for name, doc in (
            ("gbps", "KV transfer self-test at start: GB/s over this worker's path"),
            (
                "memcpy_gbps",
                "KV transfer self-test at start: GB/s of a one-thread memcpy of the same bytes",
            ),
            (
                "ratio",
                "KV transfer self-test at start: transfer / memcpy rate (low: a slow or "
                "fallback path, docs/kvtransfer.md)",
            ),
        ):
            g = GaugeMetricFamily(f"pdserve_kv_transfer_selftest_{name}", doc)
            g.add_metric([], 0.0 if t is None else getattr(t, name))
            yield g
