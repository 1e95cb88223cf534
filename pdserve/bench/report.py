"""Metrics of a run: throughput, TTFT / ITL / TPOT / e2e statistics, goodput; the JSON
document and the console table. Latencies are in milliseconds, rates per second.

Only completed requests (no error) contribute to latency statistics and throughput.
- TTFT: request sent -> first chunk with text.
- ITL: gap between consecutive text chunks, pooled over all requests.
- TPOT: per request (e2e - TTFT) / (output tokens - 1), requests with >= 2 output tokens.
- e2e: request sent -> end of stream.
- goodput: completed requests per second whose TTFT <= slo.ttft_ms and whose largest ITL
  (every gap) <= slo.itl_ms; an SLO that is not set is not checked."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.client import RequestResult
from pdserve.bench.config import BenchConfig, SloConfig
from pdserve.bench.runner import UNSENT, BenchRun
from pdserve.bench.worker_side import KVTransferStats, format_rows

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Stats:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    min: float | None
    max: float | None

    @classmethod
    def of(cls, values_ms: list[float]) -> Stats:
        if not values_ms:
            return cls(0, None, None, None, None, None, None)
        a = np.asarray(values_ms, dtype=np.float64)
        p50, p90, p99 = (float(v) for v in np.percentile(a, [50, 90, 99]))
        return cls(len(a), float(a.mean()), p50, p90, p99, float(a.min()), float(a.max()))


@dataclass(frozen=True)
class Report:
    num_requests: int
    completed: int
    failed: int
    """Sent but not completed: HTTP errors, error events, transport errors, cancelled at the
    deadline."""
    unsent: int
    """Not sent before the run deadline."""
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    """Output tokens per second."""
    total_token_throughput: float
    """(Input + output tokens) per second."""
    peak_concurrency: int
    """Most requests in flight at once, as the client saw them."""
    ttft_ms: Stats
    itl_ms: Stats
    tpot_ms: Stats
    e2e_ms: Stats
    slo_ttft_ms: float | None
    slo_itl_ms: float | None
    good_requests: int | None
    """Completed requests meeting every SLO that is set; None when no SLO is set."""
    goodput: float | None
    """good_requests per second; None when no SLO is set."""
    errors: dict[str, int]
    """Error message -> how many requests ended with it."""
    kv_transfer: KVTransferStats | None = None
    """The split path as the workers measured it (`--worker-metrics`; None: not scraped)."""


def meets_slo(r: RequestResult, slo: SloConfig) -> bool:
    if not r.ok or r.ttft is None:
        return False
    if slo.ttft_ms is not None and r.ttft * 1e3 > slo.ttft_ms:
        return False
    itls = r.itls
    if slo.itl_ms is not None and itls and max(itls) * 1e3 > slo.itl_ms:
        return False
    return True


def peak_concurrency(results: list[RequestResult]) -> int:
    events = sorted(
        ev
        for r in results
        if r.start is not None and r.end is not None
        for ev in ((r.start, 1), (r.start + r.end, -1))
    )
    peak = cur = 0
    for _, step in events:  # at equal times the end (-1) sorts first: touching is not overlap
        cur += step
        peak = max(peak, cur)
    return peak


def summarize(run: BenchRun, slo: SloConfig) -> Report:
    done = [r for r in run.results if r.ok]
    unsent = sum(r.error == UNSENT for r in run.results)
    dur = max(run.duration_s, 1e-9)
    inp = sum(r.prompt_tokens for r in done)
    out = sum(r.output_tokens for r in done)
    good = sum(meets_slo(r, slo) for r in done) if slo.enabled else None
    return Report(
        num_requests=len(run.results),
        completed=len(done),
        failed=len(run.results) - len(done) - unsent,
        unsent=unsent,
        duration_s=dur,
        input_tokens=inp,
        output_tokens=out,
        request_throughput=len(done) / dur,
        output_throughput=out / dur,
        total_token_throughput=(inp + out) / dur,
        peak_concurrency=peak_concurrency(run.results),
        ttft_ms=Stats.of([r.ttft * 1e3 for r in done if r.ttft is not None]),
        itl_ms=Stats.of([g * 1e3 for r in done for g in r.itls]),
        tpot_ms=Stats.of([r.tpot * 1e3 for r in done if r.tpot is not None]),
        e2e_ms=Stats.of([r.end * 1e3 for r in done if r.end is not None]),
        slo_ttft_ms=slo.ttft_ms,
        slo_itl_ms=slo.itl_ms,
        good_requests=good,
        goodput=None if good is None else good / dur,
        errors=dict(Counter(r.error for r in run.results if r.error is not None)),
    )


def to_json(cfg: BenchConfig, run: BenchRun, report: Report) -> dict[str, Any]:
    """The result document: schema_version, config, summary (the Report), requests."""
    config = asdict(cfg)
    config["endpoint"]["api_key"] = "***" if cfg.endpoint.api_key else None
    config["endpoint"]["model"] = run.model
    config["out"] = str(cfg.out) if cfg.out else None
    config["plot"] = str(cfg.plot) if cfg.plot else None
    config["load"]["request_rate"] = _finite(cfg.load.request_rate)
    requests = [
        {
            "index": r.index,
            "start_s": r.start,
            "ttft_ms": _ms(r.ttft),
            "e2e_ms": _ms(r.end),
            "itl_ms": [g * 1e3 for g in r.itls],
            "tpot_ms": _ms(r.tpot),
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "usage_reported": r.usage_reported,
            "error": r.error,
        }
        for r in run.results
    ]
    return {
        "schema_version": SCHEMA_VERSION,
        "started_at": run.started_at,
        "timed_out": run.timed_out,
        "config": config,
        "summary": asdict(report),
        "requests": requests,
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _finite(x: float) -> float | str:
    return x if np.isfinite(x) else "inf"


def format_table(report: Report) -> str:
    rows = [
        (
            "requests completed / failed / unsent",
            f"{report.completed} / {report.failed} / {report.unsent}",
        ),
        ("duration (s)", f"{report.duration_s:.2f}"),
        ("input / output tokens", f"{report.input_tokens} / {report.output_tokens}"),
        ("request throughput (req/s)", f"{report.request_throughput:.2f}"),
        ("output token throughput (tok/s)", f"{report.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{report.total_token_throughput:.1f}"),
        ("peak concurrency", str(report.peak_concurrency)),
    ]
    if report.goodput is not None:
        rows.append(
            (
                f"goodput (req/s; TTFT<={report.slo_ttft_ms} ms, ITL<={report.slo_itl_ms} ms)",
                f"{report.goodput:.2f} ({report.good_requests} requests)",
            )
        )
    if report.kv_transfer is not None:
        rows += format_rows(report.kv_transfer)
    lines = [f"{k:<58} {v}" for k, v in rows]
    lines.append(f"{'latency (ms)':<10} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10} {'n':>7}")
    for name, s in (
        ("TTFT", report.ttft_ms),
        ("ITL", report.itl_ms),
        ("TPOT", report.tpot_ms),
        ("e2e", report.e2e_ms),
    ):
        vals = [
            f"{v:10.2f}" if v is not None else f"{'-':>10}" for v in (s.mean, s.p50, s.p90, s.p99)
        ]
        lines.append(f"{name:<10} {' '.join(vals)} {s.count:>7}")
    for msg, n in sorted(report.errors.items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"error x{n}: {msg}")
    return "\n".join(lines)
