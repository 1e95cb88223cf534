"""The benchmark's pieces without a server: SSE parsing, arrival schedule, workloads, metrics
on hand-built results, the command line and its import cost."""

import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.client import RequestResult, parse_sse_line
from pdserve.bench.config import SloConfig, WorkloadConfig
from pdserve.bench.report import meets_slo, peak_concurrency, summarize
from pdserve.bench.runner import UNSENT, BenchRun, arrival_offsets
from pdserve.bench.workload import build_workload, word_source

REPO = Path(__file__).resolve().parents[2]


def test_parse_sse_line():
    assert parse_sse_line("", chat=False) is None
    assert parse_sse_line(": keep-alive", chat=False) is None
    assert parse_sse_line("data: [DONE]", chat=True).done
    assert parse_sse_line('data:{"choices":[{"text":"ab"},{"text":"c"}]}', chat=False).text == "abc"
    ev = parse_sse_line('data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}', chat=True)
    assert ev.text == "hi" and ev.usage is None and ev.error is None
    assert (
        parse_sse_line('data: {"choices":[{"delta":{"role":"assistant"}}]}', chat=True).text == ""
    )
    ev = parse_sse_line('data: {"choices":[],"usage":{"completion_tokens":5}}', chat=False)
    assert ev.usage == {"completion_tokens": 5} and ev.text == ""
    assert (
        parse_sse_line('data: {"error":{"message":"boom"}}', chat=False).error
        == "error event: boom"
    )
    assert parse_sse_line("data: {not json", chat=False).error.startswith("malformed")


def test_arrival_offsets():
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    offsets = arrival_offsets(4000, 10.0, 1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(0.1, rel=0.08)  # exponential: sd = mean
    assert arrival_offsets(50, 10.0, 1) == offsets[:50]
    assert arrival_offsets(50, 10.0, 2) != offsets[:50]


def test_random_workload_is_seeded_and_in_range():
    cfg = WorkloadConfig(num_requests=200, input_len=(5, 9), output_len=(3, 4), seed=7)
    specs = build_workload(cfg)
    assert specs == build_workload(cfg)
    assert specs != build_workload(
        WorkloadConfig(num_requests=200, input_len=(5, 9), output_len=(3, 4), seed=8)
    )
    assert {s.prompt_len for s in specs} == set(range(5, 10))
    assert {s.max_tokens for s in specs} == {3, 4}
    assert all(len(s.completion_prompt().split()) == s.prompt_len for s in specs)
    assert all(
        s.prefix is None and s.chat_messages() == [{"role": "user", "content": s.prompt}]
        for s in specs
    )
    assert len({s.prompt for s in specs}) == 200


def test_shared_prefix_workload():
    cfg = WorkloadConfig(
        dataset="shared-prefix",
        num_requests=60,
        num_tenants=4,
        prefix_len=30,
        input_len=(4, 4),
        output_len=(2, 2),
    )
    specs = build_workload(cfg)
    by_tenant = {}
    for s in specs:
        by_tenant.setdefault(s.tenant, set()).add(s.prefix)
        assert s.prompt_len == 34 and len(s.prefix.split()) == 30
        assert s.completion_prompt() == f"{s.prefix} {s.prompt}"
        assert s.chat_messages()[0] == {"role": "system", "content": s.prefix}
    assert sorted(by_tenant) == [0, 1, 2, 3]
    assert all(len(p) == 1 for p in by_tenant.values())  # one prefix per tenant
    assert len({next(iter(p)) for p in by_tenant.values()}) == 4  # distinct across tenants


def test_tokenizer_gives_exact_prompt_lengths():
    from engine.models.prepare import resolve_model_path
    from engine.processing.tokenizer import Tokenizer

    words = word_source("default")
    assert words.exact and len(words.words) >= 100
    tok = Tokenizer.from_dir(resolve_model_path("default"))
    for dataset in ("random", "shared-prefix"):
        cfg = WorkloadConfig(
            dataset=dataset, num_requests=20, input_len=(1, 60), prefix_len=50, seed=5
        )
        for s in build_workload(cfg, words):
            assert len(tok.encode(s.completion_prompt())) == s.prompt_len


def _result(index, start, chunks, end, tokens, error=None) -> RequestResult:
    return RequestResult(
        index=index,
        start=start,
        chunk_times=list(chunks),
        end=end,
        output_tokens=tokens,
        prompt_tokens=10,
        error=error,
    )


def test_metrics_on_hand_built_results():
    results = [
        _result(0, 0.0, [0.1, 0.2, 0.3], 0.3, 3),
        _result(1, 0.5, [0.4, 0.45, 0.9], 1.0, 3),  # TTFT 400 ms
        _result(2, 1.0, [0.05, 0.6, 0.65], 0.7, 3),  # one 550 ms gap; p50 gap is 50 ms
        _result(3, 1.0, [0.05], 0.05, 1),  # one chunk: no ITL, no TPOT
        _result(4, 1.02, [], 0.2, 0, error="HTTP 500: x"),
        _result(5, None, [], None, 0, error=UNSENT),
    ]
    run = BenchRun(model="m", results=results, duration_s=2.0, timed_out=True, started_at=0.0)
    r = summarize(run, SloConfig(ttft_ms=200, itl_ms=300))
    assert (r.completed, r.failed, r.unsent) == (4, 1, 1)
    assert r.good_requests == 2 and r.goodput == 1.0  # requests 0 and 3
    assert r.output_tokens == 10 and r.input_tokens == 40
    assert r.request_throughput == 2.0 and r.output_throughput == 5.0
    assert r.ttft_ms.count == 4 and r.ttft_ms.mean == pytest.approx((100 + 400 + 50 + 50) / 4)
    assert r.itl_ms.count == 6 and r.itl_ms.max == pytest.approx(550)
    assert r.itl_ms.p50 == pytest.approx(100)  # gaps 100 100 50 450 550 50 -> median 100
    assert r.tpot_ms.count == 3 and r.tpot_ms.min == pytest.approx(100)  # (0.3-0.1)/2
    assert r.e2e_ms.p50 == pytest.approx(500)  # 300 1000 700 50
    assert r.errors == {"HTTP 500: x": 1, UNSENT: 1}
    assert summarize(run, SloConfig()).goodput is None
    assert summarize(run, SloConfig(itl_ms=500)).good_requests == 3  # every gap, not p50
    assert not meets_slo(results[4], SloConfig())
    # In flight: [0, .3] [.5, 1.5] [1, 1.7] [1, 1.05] [1.02, 1.22] -> 4 at t=1.02
    assert r.peak_concurrency == 4
    assert peak_concurrency([_result(0, 0.0, [], 1.0, 0), _result(1, 1.0, [], 1.0, 0)]) == 1


def test_config_validation_errors():
    with pytest.raises(ValueError):
        WorkloadConfig(input_len=(5, 2))
    with pytest.raises(ValueError):
        WorkloadConfig(dataset="sharegpt")


def test_registered_in_pdserve_and_cheap_to_import():
    from pdserve.bench import cli as bench_cli
    from pdserve.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "--url",
            "http://h:1",
            "--request-rate",
            "inf",
            "--input-len-range",
            "3,9",
            "--slo-itl-ms",
            "50",
        ]
    )
    assert args.func is bench_cli._run
    cfg = bench_cli.config_from_args(args)
    assert math.isinf(cfg.load.request_rate) and cfg.workload.input_len == (3, 9)
    assert cfg.slo.itl_ms == 50 and cfg.endpoint.url == "http://h:1"
    heavy = ["httpx", "matplotlib", "torch", "numpy", "tqdm"]
    code = f"import sys, pdserve.bench.cli; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_docs_describe_every_summary_field():
    from pdserve.bench.report import Report

    doc = (REPO / "docs" / "bench.md").read_text()
    missing = [f for f in Report.__dataclass_fields__ if f"`{f}`" not in doc]
    assert not missing, f"docs/bench.md does not describe {missing}"
