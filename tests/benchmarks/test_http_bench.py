"""benchmarks/http_bench.py runs: every case answers the status it is timed for."""

import asyncio

from cpu_info import cpu_isa
from http_bench import CASES, run


def test_http_bench_quick():
    results = asyncio.run(run(seconds=0.05, repeats=1))
    assert set(results) == set(CASES)
    assert all(wall > 0 and cpu > 0 for wall, cpu in results.values())
    assert cpu_isa()
