"""benchmarks/http_bench.py runs: every case answers the status it is timed for."""

import asyncio

from cpu_info import cpu_isa
from http_bench import CASES, run


def test_http_bench_quick():
    results = asyncio.run(run(seconds=0.05, repeats=1))
    assert set(results) == set(CASES)
    assert all(wall > 0 and cpu > 0 for wall, cpu in results.values())
    assert cpu_isa()


def test_http_bench_host_check_ab():
    """The baseline stubs the check out for its run only: a rebound Host is refused again
    after it."""
    from http_bench import host_check_stubbed

    from router.http.host_check import HostCheck

    guard = HostCheck("127.0.0.1", (), keyed=False)
    rebound = {"headers": [(b"host", b"evil.example")]}
    with host_check_stubbed(True):
        assert guard.check(rebound) is None
        results = asyncio.run(run(seconds=0.05, repeats=1, stub_host_check=True))
    assert set(results) == set(CASES)
    assert guard.check(rebound).status == 421


def test_http_bench_check_alone():
    from http_bench import check_alone

    timings = check_alone(calls=100)
    assert set(timings) == {"Host + Origin", "Host only"} and all(t > 0 for t in timings.values())
