"""What the workers measured during a bench run (`--worker-metrics`): the split path's KV
transfers and handovers, from each worker's /metrics scraped before and after the run.

Per run (the difference of the two scrapes, summed over workers): prompt pushes that completed
into decode workers, bytes per push, the push's time (decode side: expected -> last block
landed, which includes the prefill worker's compute: a push streams while the prompt computes),
descriptors per transfer (prefill side, where the transport exports them) and the handover —
the prefill worker's last write complete -> first token handed to the decode worker's stream
(`pdserve_worker_kv_handover_seconds`), with the prefill worker's part of it
(`pdserve_worker_kv_handover_prefill_seconds`: its write seen complete -> its answer sent).
"""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import dataclass

from local_cluster.metrics_text import Scrape, increase, quantile, window_buckets

TRANSFER_S = "pdserve_kv_transfer_latency_seconds"
HANDOVER_S = "pdserve_worker_kv_handover_seconds"
HANDOVER_PREFILL_S = "pdserve_worker_kv_handover_prefill_seconds"
DESCRIPTORS = "vllm:nixl_num_descriptors"


@dataclass(frozen=True)
class KVTransferStats:
    """The split path as the workers saw it during the run (None: nothing observed)."""

    transfers: int
    """Prompt pushes that completed into decode workers."""
    bytes_per_transfer: float | None
    transfer_ms_p50: float | None
    transfer_ms_p99: float | None
    handovers: int
    handover_ms_p50: float | None
    handover_ms_p99: float | None
    handover_prefill_ms_p50: float | None
    """The prefill worker's part of the handover (its answer's delay)."""
    handover_prefill_ms_p99: float | None
    descriptors_per_transfer: float | None
    """Mean NIXL descriptors per transfer on the sending side (None: not exported)."""


def metrics_urls(spec: str) -> list[str]:
    """`up`: every worker of the running `pdserve up` (from etcd, through its run file);
    else comma-separated `host:port` or URLs of workers' /metrics."""
    if spec == "up":
        return [f"http://{a}/metrics" for a in _up_workers()]
    urls = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        url = item if "://" in item else f"http://{item}"
        urls.append(url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics")
    if not urls:
        raise ValueError("--worker-metrics names no worker")
    return urls


def scrape(urls: list[str], timeout_s: float = 5.0) -> list[Scrape]:
    """One scrape per URL, in order (ValueError naming one that does not answer)."""
    pages = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                pages.append(Scrape.parse(resp.read().decode()))
        except OSError as exc:
            raise ValueError(f"worker metrics at {url} did not answer: {exc}") from None
    return pages


def kv_transfer_stats(before: list[Scrape], after: list[Scrape]) -> KVTransferStats:
    """The run's figures from scrapes of the same workers before and after it."""
    transfers = descriptors = 0.0
    nbytes = 0.0
    latency: dict[float, float] = {}
    handover: dict[float, float] = {}
    handover_prefill: dict[float, float] = {}
    for old, new in zip(before, after):
        transfers += increase(new, old, "pdserve_kv_transfer_requests_total", direction="receive")
        nbytes += increase(new, old, "pdserve_kv_transfer_bytes_total", direction="receive")
        descriptors += increase(new, old, f"{DESCRIPTORS}_sum")
        _add(latency, _window(new, old, TRANSFER_S, direction="receive"))
        _add(handover, _window(new, old, HANDOVER_S))
        _add(handover_prefill, _window(new, old, HANDOVER_PREFILL_S))
    sent = sum(increase(n, o, f"{DESCRIPTORS}_count") for o, n in zip(before, after))
    handovers = int(max(handover.values(), default=0))
    return KVTransferStats(
        transfers=int(transfers),
        bytes_per_transfer=nbytes / transfers if transfers else None,
        transfer_ms_p50=_ms(quantile(latency, 0.5)),
        transfer_ms_p99=_ms(quantile(latency, 0.99)),
        handovers=handovers,
        handover_ms_p50=_ms(quantile(handover, 0.5)),
        handover_ms_p99=_ms(quantile(handover, 0.99)),
        handover_prefill_ms_p50=_ms(quantile(handover_prefill, 0.5)),
        handover_prefill_ms_p99=_ms(quantile(handover_prefill, 0.99)),
        descriptors_per_transfer=descriptors / sent if sent else None,
    )


def format_rows(stats: KVTransferStats) -> list[tuple[str, str]]:
    """Rows for the console table."""

    def ms(p50: float | None, p99: float | None) -> str:
        return "-" if p50 is None else f"p50 {p50:.2f} / p99 {p99:.2f}"

    per = stats.bytes_per_transfer
    push = ms(stats.transfer_ms_p50, stats.transfer_ms_p99)
    handover = ms(stats.handover_ms_p50, stats.handover_ms_p99)
    rows = [
        ("KV pushes completed (decode side)", str(stats.transfers)),
        ("KV bytes per push", "-" if per is None else f"{per / 2**20:.2f} MiB"),
        ("KV push time, ms (includes the prompt's compute)", push),
        ("handover, ms (last KV write complete -> first token sent)", handover),
        (
            "  of which the prefill worker's answer, ms",
            ms(stats.handover_prefill_ms_p50, stats.handover_prefill_ms_p99),
        ),
    ]
    if stats.descriptors_per_transfer is not None:
        rows.append(("descriptors per transfer", f"{stats.descriptors_per_transfer:.1f}"))
    return rows


def _window(new: Scrape, old: Scrape, histogram: str, **labels: str) -> dict[float, float]:
    if not labels:
        return window_buckets(new, old, histogram)
    after, before = new.buckets(histogram, **labels), old.buckets(histogram, **labels)
    window = {le: c - before.get(le, 0.0) for le, c in after.items()}
    return {} if any(c < 0 for c in window.values()) else window


def _add(total: dict[float, float], window: dict[float, float]) -> None:
    for le, count in window.items():
        total[le] = total.get(le, 0.0) + count


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _up_workers() -> list[str]:
    from cluster.registration import list_workers, make_client
    from local_cluster.run_file import current, etcd_credentials

    run = current()

    async def fetch():
        async with make_client(run["etcd"], etcd_credentials(run)) as client:
            return await list_workers(client, run["cluster"])

    return [w.metrics_address for w in asyncio.run(fetch()) if w.metrics_address]
