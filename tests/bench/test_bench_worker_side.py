"""`pdserve bench --worker-metrics`: the split path's figures from the workers' /metrics,
scraped before and after the run (pdserve/bench/worker_side.py) — against metrics text whose
answers are known, and through the real command against a served page."""

import http.server
import json
import threading

import pytest
from fake_openai import FakeOpenAIServer, Plan

from local_cluster.metrics_text import Scrape
from pdserve.bench.cli import main as bench_main
from pdserve.bench.worker_side import format_rows, kv_transfer_stats, metrics_urls

HANDOVER_BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)


def page(
    pushes: int, nbytes: int, handovers: list[int], prefill_parts: list[int] | None = None
) -> str:
    """A decode worker's page: `pushes` completed pushes of `nbytes` in all, all in the
    0.5-1 s latency bucket; handover counts per bucket (cumulative written out here), and
    the prefill worker's parts of them likewise (when given)."""
    lines = [
        "# TYPE pdserve_kv_transfer_requests counter",
        f'pdserve_kv_transfer_requests_total{{direction="receive",peer="P"}} {pushes}',
        "# TYPE pdserve_kv_transfer_bytes counter",
        f'pdserve_kv_transfer_bytes_total{{direction="receive",peer="P"}} {nbytes}',
        "# TYPE pdserve_kv_transfer_latency_seconds histogram",
    ]
    for le in ("0.5", "1.0", "+Inf"):
        count = 0 if le == "0.5" else pushes
        lines.append(
            "pdserve_kv_transfer_latency_seconds_bucket"
            f'{{direction="receive",peer="P",le="{le}"}} {count}'
        )
    histograms = {"pdserve_worker_kv_handover_seconds": handovers}
    if prefill_parts is not None:
        histograms["pdserve_worker_kv_handover_prefill_seconds"] = prefill_parts
    for name, counts in histograms.items():
        lines.append(f"# TYPE {name} histogram")
        cumulative = 0
        for le, n in zip((*map(str, HANDOVER_BOUNDS), "+Inf"), [*counts, 0]):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
    return "\n".join(lines) + "\n"


def test_the_run_is_the_difference_of_the_two_scrapes():
    # 10 handovers before the run (all slow); the run adds 4 under 1 ms and none slower.
    # The prefill worker's parts: 10 before (1-2 ms), the run's 4 all under 0.5 ms.
    old = Scrape.parse(
        page(3, 3 << 20, [0, 0, 0, 0, 0, 0, 0, 10, 0, 0], [0, 0, 10, 0, 0, 0, 0, 0, 0, 0])
    )
    new = Scrape.parse(
        page(7, 11 << 20, [0, 4, 0, 0, 0, 0, 0, 10, 0, 0], [4, 0, 10, 0, 0, 0, 0, 0, 0, 0])
    )
    stats = kv_transfer_stats([old], [new])
    assert stats.transfers == 4 and stats.bytes_per_transfer == 2 << 20
    assert stats.handovers == 4
    assert 0.5 <= stats.handover_ms_p50 <= 1.0 and stats.handover_ms_p99 <= 1.0
    assert stats.handover_prefill_ms_p50 <= 0.5 and stats.handover_prefill_ms_p99 <= 0.5
    assert 500 <= stats.transfer_ms_p50 <= 1000
    assert stats.descriptors_per_transfer is None  # not exported: not shown
    rows = dict(format_rows(stats))
    assert rows["KV bytes per push"] == "2.00 MiB"
    assert "descriptors per transfer" not in rows


def test_a_run_without_pushes_reports_none_rather_than_zeros():
    same = Scrape.parse(page(3, 3 << 20, [1, 0, 0, 0, 0, 0, 0, 0, 0, 0]))
    stats = kv_transfer_stats([same], [same])
    assert stats.transfers == 0 and stats.bytes_per_transfer is None
    assert stats.handover_ms_p50 is None and stats.transfer_ms_p99 is None


def test_worker_addresses():
    assert metrics_urls("127.0.0.1:9000, http://h:1/metrics") == [
        "http://127.0.0.1:9000/metrics",
        "http://h:1/metrics",
    ]
    with pytest.raises(ValueError, match="names no worker"):
        metrics_urls(" , ")


class _Pages(http.server.BaseHTTPRequestHandler):
    served: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.served.pop(0).encode() if len(self.served) > 1 else self.served[0].encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_command_reports_what_the_workers_measured(tmp_path):
    _Pages.served = [page(0, 0, [0] * 10), page(2, 4 << 20, [2, 0, 0, 0, 0, 0, 0, 0, 0, 0])]
    metrics = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=metrics.serve_forever, daemon=True)
    thread.start()
    out = tmp_path / "result.json"
    try:
        plan = Plan(ttft_s=0.01, itl_s=0.005)
        with FakeOpenAIServer(plan=lambda n, body: plan) as server:
            rc = bench_main(
                [
                    "--url", server.url, "--out", str(out), "--no-progress",
                    "--num-requests", "2", "--output-len", "2",
                    "--worker-metrics", f"127.0.0.1:{metrics.server_address[1]}",
                ]
            )  # fmt: skip
    finally:
        metrics.shutdown()
        metrics.server_close()
        thread.join(5)
    assert rc == 0
    kv = json.loads(out.read_text())["summary"]["kv_transfer"]
    assert kv["transfers"] == 2 and kv["bytes_per_transfer"] == 2 << 20
    assert kv["handovers"] == 2 and kv["handover_ms_p99"] <= 0.5


def test_a_worker_that_does_not_answer_is_named(capsys):
    """Checked before any request is sent: exit 2 naming the address."""
    rc = bench_main(
        ["--url", "http://127.0.0.1:9", "--no-progress", "--worker-metrics", "127.0.0.1:9"]
    )
    assert rc == 2
    assert "worker metrics at http://127.0.0.1:9/metrics did not answer" in capsys.readouterr().err
