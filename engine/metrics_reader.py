"""The engine's counters for offline use, as vLLM's `LLM.get_metrics()` returns them
(vllm/v1/metrics/reader.py): a list of named Counter / Gauge / Vector values, with the
names the workers export on /metrics (docs/metrics.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.llm_engine import EngineStats


@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    value: int = 0


@dataclass(frozen=True)
class Gauge(Metric):
    value: float = 0.0


@dataclass(frozen=True)
class Vector(Metric):
    """One counter per position (vLLM exports it with a `position` label)."""

    values: list[int] = field(default_factory=list)


def engine_metrics(stats: EngineStats, speculating: bool) -> list[Metric]:
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", value=stats.num_running),
        Gauge("vllm:num_requests_waiting", value=stats.num_waiting + stats.num_waiting_for_kv),
        Gauge("vllm:kv_cache_usage_perc", value=stats.kv_usage),
        Counter("vllm:prefix_cache_queries", value=stats.prefix_cache_queries),
        Counter("vllm:prefix_cache_hits", value=stats.prefix_cache_hits),
        Counter("vllm:num_preemptions", value=stats.num_preemptions),
        Counter("vllm:prompt_tokens", value=stats.prompt_tokens),
        Counter("vllm:generation_tokens", value=stats.generation_tokens),
    ]
    if speculating:  # as vLLM: only with a speculative config
        metrics += [
            Counter("vllm:spec_decode_num_drafts", value=stats.spec_num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", value=stats.spec_num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", value=stats.spec_num_accepted_tokens),
            Vector(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                values=list(stats.spec_accepted_per_pos),
            ),
        ]
    return metrics
