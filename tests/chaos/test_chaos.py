"""The short chaos run (the long one is `pdserve chaos --duration 600`, docs/chaos.md): a
`pdserve up` cluster (2 prefill + 2 decode workers, 2-layer fp32) under steady streaming load
with random client disconnects, a fault every few seconds of every kind — SIGKILL and
SIGSTOP/SIGCONT of workers, etcd killed, the router restarted — with the KV fabric on: a
small pool and a second tier on every worker (so blocks are demoted and promoted) and peer
pulls. Zero failed requests, no seeded request diverging from its other runs, no leaked KV
block on any worker, no tier slot held beyond what its worker announces, the router's KV
index equal to the workers' pools and tiers."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_short_chaos_run_fails_no_request_and_leaks_nothing(tmp_path):
    report_path = tmp_path / "report.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.chaos",
            "--duration",
            "36",
            "--fault-interval",
            "3",
            "--concurrency",
            "4",
            "--max-tokens",
            "32",
            "--seed",
            "11",
            "--report",
            str(report_path),
            "--log-dir",
            str(tmp_path / "logs"),
            "--up-arg=--kv-offloading-size=2MiB",
            "--up-arg=--worker-arg=--kv-cache-memory=1MiB",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert report_path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert len(report["faults"]) >= 6, report  # faults were really injected
    assert report["requests"].get("completed", 0) > 20, report
    assert report["requests"].get("failed", 0) == 0, report["failures"]
    assert (
        report["diverged"] == []
        and report["leaked_blocks"] == {}
        and report["kv_index_mismatch"] == 0
    )
    assert report["stranded_tier_blocks"] == {}
    assert report["fabric"]["kv_offload_demotions"] > 0, report["fabric"]  # the tier was used
    assert report["passed"] and run.returncode == 0
