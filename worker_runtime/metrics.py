"""A worker's Prometheus /metrics: engine stats, KV transfer stats (kvtransfer's own
registries), request latencies."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.llm_engine import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    def __init__(self, role: str, kv_backend) -> None:
        self.role = role
        self.kv = kv_backend
        self.registry = CollectorRegistry()
        self._stats: EngineStats | None = None
        self._step_seconds = 0.0
        self.registry.register(self)
        # KV transfer metrics (bytes, blocks, batches, requests, failures, latency histograms)
        # live in each side's own registry (kvtransfer.metrics); exported here as they are.
        self.registry.register(kv_backend.sender.metrics.registry)
        self.registry.register(kv_backend.receiver.metrics.registry)
        labels = ["role"]
        self.ttft = Histogram("pdserve_worker_ttft_seconds", "Request arrival to first token",
                              labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdserve_worker_itl_seconds", "Time between output tokens",
                             labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pdserve_worker_e2e_seconds", "Request arrival to last token",
                             labels, registry=self.registry, buckets=LATENCY_BUCKETS)
        self.prefill_modes = {}
        # Exported by both roles (a decode worker's stays 0: embeddings are prefill-only).
        self.embeddings = Counter("pdserve_worker_embeddings", "Embedding requests served",
                                  labels, registry=self.registry).labels(role)

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def update(self, stats: EngineStats, loop) -> None:
        self._stats = stats
        self._step_seconds = loop.step_seconds

    def count_prefill_mode(self, mode: str) -> None:
        self.prefill_modes[mode] = self.prefill_modes.get(mode, 0) + 1

    def collect(self):
        s = self._stats
        role = [self.role]
        if s is not None:
            for name, doc, value in [
                ("running", "Requests running", s.num_running),
                ("waiting", "Requests waiting to be scheduled", s.num_waiting),
                ("waiting_for_kv", "Requests waiting for KV from a prefill worker", s.num_waiting_for_kv),
                ("kv_usage", "Share of KV blocks in use (0..1)", s.kv_usage),
                ("kv_blocks_total", "KV blocks in the pool", s.num_blocks),
                ("kv_blocks_free", "KV blocks free (incl. cached-free)", s.num_free_blocks),
                ("queued_prefill_tokens", "Prompt tokens admitted, not yet computed", s.queued_prefill_tokens),
            ]:
                g = GaugeMetricFamily(f"pdserve_worker_{name}", doc, labels=["role"])
                g.add_metric(role, value)
                yield g
            for name, doc, value in [
                ("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
                ("prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
                ("preemptions", "Requests preempted", s.num_preemptions),
                ("prompt_tokens", "Prompt tokens computed", s.prompt_tokens),
                ("generation_tokens", "Tokens generated", s.generation_tokens),
            ]:
                c = CounterMetricFamily(f"pdserve_worker_{name}", doc, labels=["role"])
                c.add_metric(role, value)
                yield c
        steps = CounterMetricFamily("pdserve_worker_engine_step_seconds", "Time in engine steps", labels=["role"])
        steps.add_metric(role, self._step_seconds)
        yield steps
        modes = CounterMetricFamily("pdserve_worker_prefill_mode", "Requests by prefill mode",
                                    labels=["role", "mode"])
        for mode, n in self.prefill_modes.items():
            modes.add_metric([self.role, mode], n)
        yield modes
