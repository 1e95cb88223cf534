"""`pdserve bench` end to end against `FakeOpenAIServer` (scripted token timing, loopback).
Each test runs the real command (`pdserve.bench.cli.main`) and checks its JSON result
against what the fake was told to do and what it saw."""

import json
import statistics
import struct
import time

import pytest
from fake_openai import FakeOpenAIServer, Plan, prompt_words

from pdserve.bench.cli import main as bench_main
from pdserve.bench.runner import CANCELLED, arrival_offsets

SUMMARY_FIELDS = {
    "num_requests",
    "completed",
    "failed",
    "unsent",
    "duration_s",
    "input_tokens",
    "output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "peak_concurrency",
    "ttft_ms",
    "itl_ms",
    "tpot_ms",
    "e2e_ms",
    "slo_ttft_ms",
    "slo_itl_ms",
    "good_requests",
    "goodput",
    "errors",
    "kv_transfer",
}
STATS_FIELDS = {"count", "mean", "p50", "p90", "p99", "min", "max"}
REQUEST_FIELDS = {
    "index",
    "start_s",
    "ttft_ms",
    "e2e_ms",
    "itl_ms",
    "tpot_ms",
    "prompt_tokens",
    "output_tokens",
    "usage_reported",
    "error",
}


def bench(tmp_path, url: str, *args: str, rc: int = 0) -> dict:
    out = tmp_path / "result.json"
    assert bench_main(["--url", url, "--out", str(out), "--no-progress", *args]) == rc
    return json.loads(out.read_text())


def test_counts_latencies_json_and_png(tmp_path):
    plan = Plan(ttft_s=0.06, itl_s=0.02)
    with FakeOpenAIServer(plan=lambda n, body: plan) as fake:
        png = tmp_path / "cdf.png"
        doc = bench(
            tmp_path,
            fake.url,
            "--num-requests",
            "12",
            "--output-len",
            "6",
            "--input-len-range",
            "8,16",
            "--max-concurrency",
            "4",
            "--ignore-eos",
            "--slo-ttft-ms",
            "1000",
            "--plot",
            str(png),
        )
        bodies = [s.body for s in fake.served]

    s = doc["summary"]
    assert set(s) == SUMMARY_FIELDS
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(s[key]) == STATS_FIELDS
    assert set(doc) == {
        "schema_version",
        "started_at",
        "timed_out",
        "config",
        "summary",
        "requests",
    }
    assert [set(r) for r in doc["requests"]] == [REQUEST_FIELDS] * 12
    assert doc["config"]["endpoint"]["model"] == "fake-model"  # from GET /v1/models

    assert (s["completed"], s["failed"], s["unsent"]) == (12, 0, 0)
    assert s["output_tokens"] == 12 * 6
    assert s["input_tokens"] == sum(prompt_words(b) for b in bodies)
    assert s["output_throughput"] == pytest.approx(72 / s["duration_s"])
    # Injected: TTFT 60 ms, 20 ms between tokens. Upper bounds leave room for a busy machine.
    assert 55 <= s["ttft_ms"]["p50"] <= 250 and s["ttft_ms"]["p99"] <= 500
    assert s["itl_ms"]["count"] == 12 * 5
    assert 14 <= s["itl_ms"]["p50"] <= 80 and s["itl_ms"]["p90"] <= 200
    assert 15 <= s["tpot_ms"]["mean"] <= 80
    assert s["e2e_ms"]["min"] >= 60 + 5 * 20 - 10
    assert s["good_requests"] == 12
    assert s["peak_concurrency"] <= 4

    assert all(
        b["stream"]
        and b["stream_options"] == {"include_usage": True}
        and b["ignore_eos"] is True
        and b["model"] == "fake-model"
        and b["max_tokens"] == 6
        and 8 <= prompt_words(b) <= 16
        for b in bodies
    )

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 100


def _slo_plan(n: int, body) -> Plan:
    if n % 4 == 1:
        return Plan(ttft_s=1.0, itl_s=0.005)  # misses the TTFT SLO
    if n % 4 == 2:
        return Plan(ttft_s=0.005, itl_s=(0.005, 1.0, 0.005))  # one gap misses the ITL SLO
    return Plan(ttft_s=0.005, itl_s=0.005)


def test_goodput_counts_exactly_the_requests_meeting_the_slos(tmp_path):
    with FakeOpenAIServer(plan=_slo_plan) as fake:
        both = bench(
            tmp_path,
            fake.url,
            "--num-requests",
            "16",
            "--output-len",
            "4",
            "--max-concurrency",
            "8",
            "--slo-ttft-ms",
            "500",
            "--slo-itl-ms",
            "500",
        )
        ttft_only = bench(
            tmp_path,
            fake.url,
            "--num-requests",
            "16",
            "--output-len",
            "4",
            "--max-concurrency",
            "8",
            "--slo-ttft-ms",
            "500",
        )
        assert len(fake.served) == 32

    s = both["summary"]
    assert s["completed"] == 16 and s["good_requests"] == 8  # n % 4 in {0, 3}
    assert s["goodput"] == pytest.approx(8 / s["duration_s"])
    assert ttft_only["summary"]["good_requests"] == 12  # the slow-gap requests count now
    assert ttft_only["summary"]["slo_itl_ms"] is None
    # The slow gap shows in the pooled ITL tail: 4 of 48 gaps are ~1 s.
    assert s["itl_ms"]["max"] >= 990 and s["itl_ms"]["p50"] < 300


def test_poisson_arrivals_match_the_rate(tmp_path):
    rate, n = 40.0, 80
    with FakeOpenAIServer(plan=lambda i, body: Plan(ttft_s=0.002, itl_s=0.002)) as fake:
        doc = bench(
            tmp_path,
            fake.url,
            "--num-requests",
            str(n),
            "--output-len",
            "2",
            "--request-rate",
            str(rate),
            "--seed",
            "3",
        )
        arrivals = sorted(s.arrival for s in fake.served)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    mean = statistics.fmean(gaps)
    assert 0.7 / rate <= mean <= 1.3 / rate
    # Exponential gaps: coefficient of variation ~1 (evenly spaced arrivals would give ~0).
    assert 0.6 <= statistics.pstdev(gaps) / mean <= 1.5
    # The sent times follow the seeded schedule.
    planned = arrival_offsets(n, rate, 3)
    starts = [r["start_s"] for r in doc["requests"]]
    assert statistics.median(abs(a - b) for a, b in zip(starts, planned)) < 0.05
    assert doc["summary"]["duration_s"] >= planned[-1]


@pytest.mark.parametrize("limit", [3, None])
def test_max_concurrency_is_never_exceeded(tmp_path, limit):
    with FakeOpenAIServer(plan=lambda n, body: Plan(ttft_s=0.03, itl_s=0.01)) as fake:
        extra = ["--max-concurrency", str(limit)] if limit else []
        doc = bench(tmp_path, fake.url, "--num-requests", "15", "--output-len", "4", *extra)
    assert doc["summary"]["completed"] == 15
    if limit:
        assert fake.max_active == limit  # reached, never exceeded
        assert doc["summary"]["peak_concurrency"] <= limit
    else:  # the control: without the limit the fake does see more
        assert fake.max_active > 3


def _failing_plan(n: int, body) -> Plan:
    if n % 5 == 0:
        return Plan(http_status=500)
    if n % 5 == 1:
        return Plan(error_after=2)
    return Plan(ttft_s=0.005, itl_s=0.005)


def test_error_responses_are_counted(tmp_path):
    with FakeOpenAIServer(plan=_failing_plan) as fake:
        doc = bench(
            tmp_path,
            fake.url,
            "--num-requests",
            "15",
            "--output-len",
            "4",
            "--max-concurrency",
            "5",
            "--slo-ttft-ms",
            "1000",
            "--slo-itl-ms",
            "1000",
        )
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["unsent"]) == (9, 6, 0)
    assert s["errors"] == {
        "HTTP 500: scripted failure 500": 3,
        "error event: scripted mid-stream failure": 3,
    }
    assert s["output_tokens"] == 9 * 4 and s["good_requests"] == 9
    assert s["ttft_ms"]["count"] == 9  # failed requests add no latency samples
    failed = [r for r in doc["requests"] if r["error"]]
    assert len(failed) == 6 and all(
        r["output_tokens"] == 0 or r["error"].startswith("error event") for r in failed
    )


def test_unreachable_server_and_bad_key(tmp_path, capsys):
    with FakeOpenAIServer(api_key="sekret") as fake:
        # Without --model the bench asks /v1/models first: a clean usage error (rc 2).
        assert bench_main(["--url", fake.url, "--num-requests", "2", "--no-progress"]) == 2
        assert "HTTP 401" in capsys.readouterr().err
        doc = bench(
            tmp_path, fake.url, "--api-key", "sekret", "--num-requests", "2", "--output-len", "2"
        )
        assert doc["summary"]["completed"] == 2
        assert doc["config"]["endpoint"]["api_key"] == "***"
        url = fake.url
    # The server is gone: every request fails, nothing crashes, rc 1 (nothing completed).
    doc = bench(tmp_path, url, "--model", "m", "--num-requests", "3", rc=1)
    s = doc["summary"]
    assert (s["completed"], s["failed"]) == (0, 3)
    assert all(k.startswith("ConnectError") for k in s["errors"])
    assert s["ttft_ms"]["mean"] is None


def test_run_deadline_cancels_and_leaves_unsent(tmp_path):
    def plan(n: int, body) -> Plan:
        return Plan(ttft_s=30.0) if n == 0 else Plan(ttft_s=0.005, itl_s=0.005)

    with FakeOpenAIServer(plan=plan) as fake:
        t = time.monotonic()
        doc = bench(
            tmp_path,
            fake.url,
            "--num-requests",
            "12",
            "--output-len",
            "2",
            "--request-rate",
            "4",
            "--timeout",
            "1.0",
        )
        elapsed = time.monotonic() - t
    s = doc["summary"]
    assert elapsed < 8 and doc["timed_out"] is True
    assert doc["requests"][0]["error"] == CANCELLED
    assert s["unsent"] >= 3 and s["failed"] == 1
    assert s["completed"] + s["failed"] + s["unsent"] == 12
    assert s["errors"][CANCELLED] == 1


def test_chat_shared_prefix_without_usage(tmp_path):
    plan = Plan(ttft_s=0.005, itl_s=0.005, tokens_per_chunk=2, usage=False)
    with FakeOpenAIServer(plan=lambda n, body: plan) as fake:
        doc = bench(
            tmp_path,
            fake.url,
            "--endpoint",
            "chat",
            "--dataset",
            "shared-prefix",
            "--num-tenants",
            "3",
            "--prefix-len",
            "40",
            "--input-len",
            "5",
            "--num-requests",
            "12",
            "--output-len",
            "6",
        )
        bodies = [s.body for s in fake.served]
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 3
    assert all([m["role"] for m in b["messages"]] == ["system", "user"] for b in bodies)
    assert all(len(b["messages"][0]["content"].split()) == 40 for b in bodies)
    assert all(len(b["messages"][1]["content"].split()) == 5 for b in bodies)
    s = doc["summary"]
    # No usage chunk: output tokens are counted as text chunks (6 tokens in 3 chunks).
    assert s["completed"] == 12 and s["output_tokens"] == 12 * 3
    assert s["input_tokens"] == 12 * 45  # the workload's intended lengths
    assert not any(r["usage_reported"] for r in doc["requests"])
