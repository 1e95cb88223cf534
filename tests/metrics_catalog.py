"""The metric names docs/metrics.md lists, and the names the code exports (read from the real
collectors, fed a fake EngineStats), for the tests that keep docs, code and dashboards in step."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "metrics.md"
_ROW = re.compile(r"^\| `([a-zA-Z_:][a-zA-Z0-9_:]*)` \| (\w+) \| (\w+) \|")
_TYPE = re.compile(r"^# TYPE (\S+) (\w+)$", re.M)
#: Exported only by a worker whose engine speculates (--speculative-config), as vLLM's.
SPECULATIVE_PREFIXES = ("vllm:spec_decode_", "pdserve_worker_spec_")


def speculative_only(name: str) -> bool:
    return name.startswith(SPECULATIVE_PREFIXES)


def documented() -> dict[str, tuple[str, str]]:
    """name (as in a `# TYPE` line) -> (type, process) for every row of the doc's table."""
    rows: dict[str, tuple[str, str]] = {}
    for line in DOC.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} listed twice"
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def type_lines(exposition: str) -> dict[str, str]:
    """name -> type of every `# TYPE` line of Prometheus text (less prometheus_client's
    `*_created` timestamp gauges)."""
    return {
        n: t for n, t in _TYPE.findall(exposition) if not (n.endswith("_created") and t == "gauge")
    }


def exported() -> dict[str, dict[str, str]]:
    """process ('router', 'worker') -> {name: type} of what the code's collectors export (a
    worker with speculative decoding on, so its spec-decode counters are included)."""
    from prometheus_client import generate_latest

    from engine.llm_engine import EngineStats
    from kvtransfer.metrics import TransferMetrics
    from router.metrics import RouterMetrics
    from worker_runtime.metrics import WorkerMetrics

    kv = SimpleNamespace(
        sender=SimpleNamespace(metrics=TransferMetrics("send")),
        receiver=SimpleNamespace(metrics=TransferMetrics("receive")),
    )
    worker = WorkerMetrics("decode", kv, "model", num_speculative_tokens=2)
    worker.update(
        EngineStats(*([1] * 12), spec_accepted_per_pos=(1, 1)), SimpleNamespace(step_seconds=0.0)
    )
    return {
        "router": type_lines(generate_latest(RouterMetrics().registry).decode()),
        "worker": type_lines(generate_latest(worker.registry).decode()),
    }


def series_names(exported_types: dict[str, str]) -> set[str]:
    """Every series name a query may use: histograms' _bucket/_sum/_count, counters as named."""
    names: set[str] = set()
    for name, kind in exported_types.items():
        names.add(name)
        if kind == "histogram":
            names |= {name + s for s in ("_bucket", "_sum", "_count")}
    return names
