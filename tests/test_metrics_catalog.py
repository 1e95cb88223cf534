"""docs/metrics.md and the code's collectors list the same metrics, with the same types (the
real-process check is tests/router/test_e2e_metrics.py)."""

from types import SimpleNamespace

from metrics_catalog import documented, exported, speculative_only

VLLM = {  # vLLM's names (vllm/v1/metrics/loggers.py) the issue asks for, as exported
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    # vllm/v1/spec_decode/metrics.py (only with a speculative config, as in vLLM)
    "vllm:spec_decode_num_drafts_total": "counter",
    "vllm:spec_decode_num_draft_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "counter",
}


def test_every_documented_metric_is_exported_and_every_exported_one_documented():
    doc = documented()
    code = exported()
    for process, names in code.items():
        listed = {n: t for n, (t, p) in doc.items() if p == process}
        assert names == listed, (process, set(names) ^ set(listed))
    assert set(doc) == set(code["router"]) | set(code["worker"])


def test_workers_export_vllm_names_with_vllm_labels():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    worker = exported()["worker"]
    assert {n: worker.get(n) for n in VLLM} == VLLM
    assert not any(n.startswith("vllm:") for n in exported()["router"])
    # labels: model_name and engine as vLLM's, plus role
    from types import SimpleNamespace

    from engine.llm_engine import EngineStats
    from kvtransfer.metrics import TransferMetrics
    from worker_runtime.metrics import WorkerMetrics

    kv = SimpleNamespace(
        sender=SimpleNamespace(metrics=TransferMetrics("send")),
        receiver=SimpleNamespace(metrics=TransferMetrics("receive")),
    )
    m = WorkerMetrics("decode", kv, "SmolLM2")
    m.update(
        EngineStats(2, 3, 4, 100, 25, 0.75, 10, 6, 1, 9, 8, 0), SimpleNamespace(step_seconds=0)
    )
    m.ttft.labels("decode").observe(0.2)
    m.itl.labels("decode").observe(0.02)
    m.e2e.labels("decode").observe(1.0)
    values = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                assert s.labels.get("model_name") == "SmolLM2" and s.labels["engine"] == "0"
                assert s.labels["role"] == "decode"
                values.setdefault(s.name, s.value)
    assert values["vllm:num_requests_running"] == 2
    assert values["vllm:num_requests_waiting"] == 3 + 4  # parked for KV counts as waiting
    assert values["vllm:kv_cache_usage_perc"] == 0.75
    assert values["vllm:prefix_cache_queries_total"] == 10
    assert values["vllm:prefix_cache_hits_total"] == 6
    assert values["vllm:num_preemptions_total"] == 1
    assert values["vllm:prompt_tokens_total"] == 9
    assert values["vllm:generation_tokens_total"] == 8
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        assert values[f"vllm:{name}_count"] == 1
    # pdserve's own names observed too
    assert m.registry.get_sample_value("pdserve_worker_ttft_seconds_count", {"role": "decode"}) == 1


def _samples(registry) -> dict[tuple[str, tuple], float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }


def _worker(num_speculative_tokens: int):
    from kvtransfer.metrics import TransferMetrics
    from worker_runtime.metrics import WorkerMetrics

    kv = SimpleNamespace(
        sender=SimpleNamespace(metrics=TransferMetrics("send")),
        receiver=SimpleNamespace(metrics=TransferMetrics("receive")),
    )
    return WorkerMetrics("decode", kv, "SmolLM2", num_speculative_tokens)


def test_spec_decode_counters_under_vllm_names_only_when_speculating():
    from engine.llm_engine import EngineStats

    stats = EngineStats(
        1,
        0,
        0,
        100,
        50,
        0.5,
        0,
        0,
        0,
        9,
        30,
        0,
        spec_num_drafts=10,
        spec_num_draft_tokens=28,
        spec_num_accepted_tokens=13,
        spec_accepted_per_pos=(7, 4, 2, 0),
    )
    m = _worker(num_speculative_tokens=4)
    m.update(stats, SimpleNamespace(step_seconds=0))
    values = _samples(m.registry)
    vllm = (("engine", "0"), ("model_name", "SmolLM2"), ("role", "decode"))
    assert values[("vllm:spec_decode_num_drafts_total", vllm)] == 10
    assert values[("vllm:spec_decode_num_draft_tokens_total", vllm)] == 28
    assert values[("vllm:spec_decode_num_accepted_tokens_total", vllm)] == 13
    # one series per position 0..k-1, from the start
    per_pos = {
        dict(labels)["position"]: v
        for (name, labels), v in values.items()
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {"0": 7, "1": 4, "2": 2, "3": 0}
    ours = (("role", "decode"),)
    assert values[("pdserve_worker_spec_drafts_total", ours)] == 10
    assert values[("pdserve_worker_spec_draft_tokens_total", ours)] == 28
    assert values[("pdserve_worker_spec_accepted_tokens_total", ours)] == 13
    assert (
        values[
            (
                "pdserve_worker_spec_accepted_tokens_per_pos_total",
                (("position", "1"), ("role", "decode")),
            )
        ]
        == 4
    )

    off = _worker(num_speculative_tokens=0)
    off.update(stats, SimpleNamespace(step_seconds=0))
    assert not [name for name, _ in _samples(off.registry) if speculative_only(name)]
    assert all(speculative_only(n) for n in VLLM if "spec_decode" in n)
