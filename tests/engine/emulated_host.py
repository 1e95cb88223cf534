"""Running tests in a child process as a CPU with less than this one would: the kernels
built for another -march, ATen and oneDNN capped by their environment variables (used by
test_cpu_kernels_avx2.py and test_cpu_prefill_avx512_bf16.py)."""

import os
import subprocess
import sys
from pathlib import Path

from engine import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def cpu_has(*flags: str) -> bool:
    """Whether /proc/cpuinfo lists every one of `flags`."""
    words = set(cpu_kernels._cpu_flags().split())
    return all(f in words for f in flags)


def run_as(host: dict[str, str], args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`python *args` from the repository root with `host`'s variables added."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **host},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_tests_as(host: dict[str, str], tests: list[str], timeout: float) -> None:
    """pytest over `tests` in such a child; fails with its output unless all of them pass."""
    run = run_as(host, ["-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], timeout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout.splitlines()[-1]
