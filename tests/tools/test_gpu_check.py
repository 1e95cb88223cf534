"""tools/gpu/gpu_check: the dry run (CPU, Triton interpreter, tiny shapes, a random-weight
2-layer model) goes through every step and reports each; a spent time budget skips the
late steps instead of overrunning."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_check
import gpu_measure
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run(tmp_path, model_dir):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            str(REPO / "tools/gpu/gpu_check.sh"),
            "--dry-run",
            "--random-from",
            str(model_dir),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    model = Path(report["model"])
    assert (
        model.parent == tmp_path
        and json.loads((model / "config.json").read_text())["num_hidden_layers"] == 2
    )
    assert report["pytest"]["returncode"] == 0 and "skipped" in report["pytest"]["summary"]
    assert report["copy_gbps"] > 0
    variants = {r["variant"]: r for r in report["decode"]}
    assert set(variants) == set(gpu_measure.DRY_VARIANTS)
    assert variants["split=32"]["partitions"] > 1 and variants["no-split"]["partitions"] == 1
    assert report["prefill"]["ms"] > 0
    engine = report["engine"]
    assert engine["triton"]["generated_tokens"] == engine["torch"]["generated_tokens"] == 2, engine
    assert 0 < engine["triton"]["kv_pool"]["pool_gib"] * 2**30 <= 64 << 20
    assert engine["greedy_agreement"]["identical_completions"] == 1.0
    transfer = report["transfer"]
    assert {(r["block_tokens"], r["total_mib"]) for r in transfer["rows"]} == {
        (16, 1),
        (16, 64),
        (64, 1),
        (64, 64),
    }
    assert (
        all(r["nixl_gbps"] > 0 for r in transfer["rows"])
        and transfer["worst_fraction_at_64mib_plus"] > 0
    )
    (row,) = report["pd"]["rows"]
    assert row["prompt_tokens"] == 64 and row["local_ttft_ms"] > 0 and row["disagg_ttft_ms"] > 0
    assert "- NIXL transfer: worst" in proc.stdout
    tp = report["tp"]  # two CPU ranks over gloo in the dry run; fp32: the same tokens
    assert tp["tp1"]["generated_tokens"] == tp["tp2"]["generated_tokens"] == 8, tp
    assert tp["greedy_agreement"]["identical_completions"] == 1.0 and tp["tp2_over_tp1"] > 0
    assert "- tensor parallelism: TP=2" in proc.stdout
    assert report["pd"]["by_chunk"] == {"512": report["pd"]["rows"]} and row["chunk_tokens"] == 512
    assert "- TTFT 64 tokens (chunks of 512): local" in proc.stdout
    for name in (
        "pytest.log",
        "kv_transfer.log",
        "pd_bench_512.log",
        "pd_logs/512/prefill.log",
        "pd_logs/512/decode.log",
    ):
        assert (out / name).is_file(), name


def test_spent_budget_skips_the_late_steps(tmp_path, model_dir):
    code = gpu_check.main(
        [
            "--dry-run",
            "--skip-pytest",
            "--model",
            str(model_dir),
            "--budget-s",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0 and report["pytest"] == {"skipped": "--skip-pytest"}
    for key in ("engine", "transfer", "pd", "tp"):
        assert report[key]["skipped"].startswith("time budget"), report[key]
    assert report["copy_gbps"] > 0  # the early steps have no minimum
