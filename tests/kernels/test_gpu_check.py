"""benchmarks/gpu_check: the dry run (CPU, Triton interpreter, tiny shapes) goes through every
step, and the engine step measures whatever `engine.LLM` offers."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks import gpu_check  # noqa: E402


def test_dry_run(tmp_path, model_dir):
    # model_dir (tests/conftest.py) prepares the bundled model the engine step loads.
    report_path = tmp_path / "report.json"
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--json", str(report_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["pytest"]["returncode"] in (0, 5)
    assert report["copy_gbps"] > 0
    variants = {r["variant"]: r for r in report["decode"]}
    assert set(variants) == set(gpu_check.DRY_VARIANTS)
    assert variants["split=32"]["partitions"] > 1 and variants["no-split"]["partitions"] == 1
    assert report["prefill"]["ms"] > 0
    engine = report["engine"]
    assert engine["triton"]["generated_tokens"] == engine["torch"]["generated_tokens"] == 2, engine


def test_engine_step_without_engine_llm(monkeypatch):
    monkeypatch.setitem(sys.modules, "engine", types.ModuleType("engine"))
    result = gpu_check.engine_throughput(torch.device("cpu"), dry_run=True)
    assert "TODO(engine)" in result["skipped"]


def test_engine_step_measures_both_backends(monkeypatch):
    fake = types.ModuleType("engine")
    backends = []

    class SamplingParams:
        def __init__(self, max_tokens, temperature, ignore_eos):
            self.max_tokens = max_tokens

    class LLM:
        def __init__(self, model=None, attention_backend="torch", device="cuda"):
            backends.append((attention_backend, device))

        def generate(self, prompts, params):
            completion = types.SimpleNamespace(token_ids=list(range(params.max_tokens)))
            return [types.SimpleNamespace(outputs=[completion]) for _ in prompts]

    fake.LLM, fake.SamplingParams = LLM, SamplingParams
    monkeypatch.setitem(sys.modules, "engine", fake)
    result = gpu_check.engine_throughput(torch.device("cpu"), dry_run=True)
    assert backends == [("triton", "cpu"), ("torch", "cpu")]
    assert result["triton"]["generated_tokens"] == 2 and "speedup" in result
