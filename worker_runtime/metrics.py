"""A worker's Prometheus /metrics: engine stats, request latencies, and the KV transfer
metrics (worker_runtime/kv_transfer_metrics.py: transfers, handover, pulls, the self-test).
docs/metrics.md lists every name.

Besides pdserve's own `pdserve_worker_*` names, the engine-level stats are also exported under
vLLM's names (`vllm:*`, labels `model_name`, `engine`, plus `role`), so dashboards and
autoscalers written for vLLM work unchanged. The request latency histograms under vLLM's names
are observed by decode workers (where a completion request arrives and its tokens leave, like
vLLM's engine); a prefill worker exports them empty. The speculative-decoding counters exist only
on a worker whose engine speculates (a decode worker given --speculative-config), as vLLM
registers them only when a speculative config is set.

The `role` label of the engine gauges and counters is the role served now: after a switch
(`Worker.SetRole`) the same series continue under the new role; `pdserve_worker_role` says
which role is served and `pdserve_worker_role_switches_total` counts the switches."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cluster.registration import ROLES, TransferSelftest
from engine.llm_engine import EngineStats
from worker_runtime.kv_transfer_metrics import KVTransferMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


#: vLLM's engine-level names (vllm/v1/metrics/loggers.py) -> the EngineStats field behind them.
VLLM_GAUGES = (
    (
        "vllm:num_requests_running",
        "Number of requests in model execution batches",
        lambda s: s.num_running,
    ),
    # vLLM counts requests waiting for remote KV (WAITING_FOR_REMOTE_KVS) as waiting too.
    (
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed",
        lambda s: s.num_waiting + s.num_waiting_for_kv,
    ),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage", lambda s: s.kv_usage),
)
VLLM_COUNTERS = (  # exported with the `_total` suffix, as vLLM's are
    (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens",
        lambda s: s.prefix_cache_queries,
    ),
    (
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens",
        lambda s: s.prefix_cache_hits,
    ),
    (
        "vllm:num_preemptions",
        "Cumulative number of preemptions from the engine",
        lambda s: s.num_preemptions,
    ),
    ("vllm:prompt_tokens", "Number of prefill tokens processed", lambda s: s.prompt_tokens),
    (
        "vllm:generation_tokens",
        "Number of generation tokens processed",
        lambda s: s.generation_tokens,
    ),
)
VLLM_LABELS = ["model_name", "engine", "role"]
#: vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py) and pdserve's twins, `_total`
#: suffixed; per-position acceptance is `vllm:spec_decode_num_accepted_tokens_per_pos` (below).
SPEC_COUNTERS = (
    (
        "vllm:spec_decode_num_drafts",
        "pdserve_worker_spec_drafts",
        "Number of spec decoding drafts.",
        lambda s: s.spec_num_drafts,
    ),
    (
        "vllm:spec_decode_num_draft_tokens",
        "pdserve_worker_spec_draft_tokens",
        "Number of draft tokens.",
        lambda s: s.spec_num_draft_tokens,
    ),
    (
        "vllm:spec_decode_num_accepted_tokens",
        "pdserve_worker_spec_accepted_tokens",
        "Number of accepted tokens.",
        lambda s: s.spec_num_accepted_tokens,
    ),
)
# vLLM's own bucket bounds for these histograms (v1 loggers).
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
VLLM_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _Both:
    """Observes into pdserve's histogram child and vLLM's at once (callers keep using
    `metrics.ttft.labels(role).observe(x)`)."""

    def __init__(self, ours: Histogram, theirs) -> None:
        self._ours, self._theirs = ours, theirs

    def labels(self, *values: str) -> "_Both":
        return _Both(self._ours.labels(*values), self._theirs)

    def observe(self, value: float) -> None:
        self._ours.observe(value)
        self._theirs.observe(value)


class WorkerMetrics:
    def __init__(
        self, role: str, kv_backend, model_name: str = "", num_speculative_tokens: int = 0
    ) -> None:
        self.role = role
        self.model_name = model_name
        self.num_speculative_tokens = num_speculative_tokens  # 0: no speculation, no spec metrics
        self.kv = kv_backend
        self.registry = CollectorRegistry()
        self._stats: EngineStats | None = None
        self._step_seconds = 0.0
        self.registry.register(self)
        self.transfer = KVTransferMetrics(
            self.registry, kv_backend, model_name, role, LATENCY_BUCKETS
        )
        # The workers use the KV transfer metrics under these names.
        self.kv_pulls = self.transfer.kv_pulls
        self.kv_pull_blocks = self.transfer.kv_pull_blocks
        self.kv_pull_seconds = self.transfer.kv_pull_seconds
        self.kv_handover = self.transfer.kv_handover
        self.kv_handover_prefill = self.transfer.kv_handover_prefill
        self.kv_exports = self.transfer.kv_exports
        self.kv_export_blocks = self.transfer.kv_export_blocks
        labels = ["role"]
        vllm = [model_name, "0", role]
        self.ttft = _Both(
            Histogram(
                "pdserve_worker_ttft_seconds",
                "Request arrival to first token",
                labels,
                registry=self.registry,
                buckets=LATENCY_BUCKETS,
            ),
            Histogram(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in "
                "seconds (decode worker: Generate call to first token)",
                VLLM_LABELS,
                registry=self.registry,
                buckets=VLLM_TTFT_BUCKETS,
            ).labels(*vllm),
        )
        self.itl = _Both(
            Histogram(
                "pdserve_worker_itl_seconds",
                "Time between output tokens",
                labels,
                registry=self.registry,
                buckets=LATENCY_BUCKETS,
            ),
            Histogram(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds",
                VLLM_LABELS,
                registry=self.registry,
                buckets=VLLM_ITL_BUCKETS,
            ).labels(*vllm),
        )
        self.e2e = _Both(
            Histogram(
                "pdserve_worker_e2e_seconds",
                "Request arrival to last token",
                labels,
                registry=self.registry,
                buckets=LATENCY_BUCKETS,
            ),
            Histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds",
                VLLM_LABELS,
                registry=self.registry,
                buckets=VLLM_E2E_BUCKETS,
            ).labels(*vllm),
        )
        self.prefill_modes: dict[str, int] = {}
        # Exported by both roles (a decode worker's stays 0: embeddings are prefill-only).
        self.embeddings = Counter(
            "pdserve_worker_embeddings", "Embedding requests served", labels, registry=self.registry
        ).labels(role)
        self.role_switches = Counter(
            "pdserve_worker_role_switches",
            "Role switches (Worker.SetRole), by the role left and the role taken",
            ["from_role", "to_role"],
            registry=self.registry,
        )

    def set_role(self, role: str, previous: str) -> None:
        """The worker switched from `previous` to `role`."""
        self.role = role
        self.role_switches.labels(previous, role).inc()
        self.transfer.set_role(role)

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def update(self, stats: EngineStats, loop) -> None:
        self._stats = stats
        self._step_seconds = loop.step_seconds

    def set_transfer_selftest(self, result: TransferSelftest) -> None:
        """The KV transfer self-test at start (worker_runtime/process.py)."""
        self.transfer.set_selftest(result)

    def count_prefill_mode(self, mode: str) -> None:
        self.prefill_modes[mode] = self.prefill_modes.get(mode, 0) + 1

    def collect(self):
        s = self._stats
        role = [self.role]
        if s is not None:
            for name, doc, value in [
                ("running", "Requests running", s.num_running),
                ("waiting", "Requests waiting to be scheduled", s.num_waiting),
                (
                    "waiting_for_kv",
                    "Requests waiting for KV from a prefill worker",
                    s.num_waiting_for_kv,
                ),
                ("kv_usage", "Share of KV blocks in use (0..1)", s.kv_usage),
                ("kv_blocks_total", "KV blocks in the pool", s.num_blocks),
                ("kv_blocks_free", "KV blocks free (incl. cached-free)", s.num_free_blocks),
                (
                    "queued_prefill_tokens",
                    "Prompt tokens admitted, not yet computed",
                    s.queued_prefill_tokens,
                ),
                (
                    "kv_offload_blocks_total",
                    "KV blocks the offloading tier holds at most (0: off)",
                    s.kv_offload_blocks,
                ),
                (
                    "kv_offload_blocks_used",
                    "KV blocks held in the offloading tier",
                    s.kv_offload_blocks_used,
                ),
            ]:
                g = GaugeMetricFamily(f"pdserve_worker_{name}", doc, labels=["role"])
                g.add_metric(role, value)
                yield g
            for name, doc, value in [
                (
                    "prefix_cache_queries_tokens",
                    "Prompt tokens looked up in the prefix cache",
                    s.prefix_cache_queries,
                ),
                (
                    "prefix_cache_hits_tokens",
                    "Prompt tokens found in the prefix cache",
                    s.prefix_cache_hits,
                ),
                ("preemptions", "Requests preempted", s.num_preemptions),
                ("prompt_tokens", "Prompt tokens computed", s.prompt_tokens),
                ("generation_tokens", "Tokens generated", s.generation_tokens),
                (
                    "kv_offload_hits_tokens",
                    "Prompt tokens promoted from the offloading tier "
                    "(part of the prefix cache hits)",
                    s.kv_offload_hits,
                ),
                (
                    "kv_offload_demotions",
                    "KV blocks copied from the pool into the offloading tier",
                    s.kv_offload_demotions,
                ),
                (
                    "kv_offload_promotions",
                    "KV blocks copied from the offloading tier back into the pool",
                    s.kv_offload_promotions,
                ),
                (
                    "kv_offload_evictions",
                    "KV blocks the full offloading tier dropped",
                    s.kv_offload_evictions,
                ),
                (
                    "kv_offload_swap_outs",
                    "Preempted requests whose partial KV blocks were swapped "
                    "out to the offloading tier",
                    s.kv_offload_swap_outs,
                ),
                (
                    "kv_offload_swap_ins",
                    "Preempted requests resumed from their swapped-out KV "
                    "instead of recomputing it",
                    s.kv_offload_swap_ins,
                ),
            ]:
                c = CounterMetricFamily(f"pdserve_worker_{name}", doc, labels=["role"])
                c.add_metric(role, value)
                yield c
            vllm = [self.model_name, "0", self.role]
            for name, doc, value in VLLM_GAUGES:
                g = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
                g.add_metric(vllm, value(s))
                yield g
            for name, doc, value in VLLM_COUNTERS:
                c = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
                c.add_metric(vllm, value(s))
                yield c
            if self.num_speculative_tokens:
                yield from self._spec_decode(s, vllm)
        steps = CounterMetricFamily(
            "pdserve_worker_engine_step_seconds", "Time in engine steps", labels=["role"]
        )
        steps.add_metric(role, self._step_seconds)
        yield steps
        served = GaugeMetricFamily(
            "pdserve_worker_role",
            "1 for the role this worker serves now, 0 for the other",
            labels=["role"],
        )
        for r in ROLES:
            served.add_metric([r], 1.0 if r == self.role else 0.0)
        yield served
        modes = CounterMetricFamily(
            "pdserve_worker_prefill_mode", "Requests by prefill mode", labels=["role", "mode"]
        )
        for mode, n in self.prefill_modes.items():
            modes.add_metric([self.role, mode], n)
        yield modes
        yield from self.transfer.collect_selftest()

    def _spec_decode(self, s: EngineStats, vllm: list[str]):
        for vllm_name, name, doc, value in SPEC_COUNTERS:
            for family, labels, values in (
                (vllm_name, VLLM_LABELS, vllm),
                (name, ["role"], [self.role]),
            ):
                c = CounterMetricFamily(family, doc, labels=labels)
                c.add_metric(values, value(s))
                yield c
        # One series per draft position 0..k-1 from the start, as vLLM's.
        per_pos = s.spec_accepted_per_pos
        doc = "Accepted tokens per draft position."
        theirs = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", doc, labels=[*VLLM_LABELS, "position"]
        )
        ours = CounterMetricFamily(
            "pdserve_worker_spec_accepted_tokens_per_pos", doc, labels=["role", "position"]
        )
        for pos, n in enumerate(per_pos):
            theirs.add_metric([*vllm, str(pos)], n)
            ours.add_metric([self.role, str(pos)], n)
        yield theirs
        yield ours
