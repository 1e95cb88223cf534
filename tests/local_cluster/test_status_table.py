"""`pdserve status`'s worker table (local_cluster/cli.py worker_table): a worker with a second
KV tier shows its used/total tier blocks, one without shows `-`; each worker's KV transfer
self-test shows as GB/s (ratio to memcpy), `failed` or `-`, and a failed or slow one gets a
note with its path; the columns stay aligned."""

from cluster.registration import Capacity, TransferSelftest, WorkerInfo
from local_cluster.cli import selftest_notes, worker_table


def _worker(wid, role, selftest=None, **cap):
    return WorkerInfo(
        wid,
        role,
        "127.0.0.1:5000",
        "m",
        "c",
        16,
        capacity=Capacity(
            total_blocks=100, free_blocks=40, running=2, waiting=1, queued_prefill_tokens=7, **cap
        ),
        transfer_selftest=selftest,
    )


def test_tier_usage_is_shown_for_workers_that_have_a_tier():
    header, tiered, plain = worker_table(
        [
            _worker("d1", "decode", kv_offload_total_blocks=4096, kv_offload_used_blocks=120),
            _worker("p1", "prefill"),
        ]
    )
    assert "KV tier used/total" in header
    assert "120/4096" in tiered.split() and "40/100" in tiered.split()
    assert "-" in plain.split() and "/4096" not in plain
    assert len(tiered) == len(plain)  # aligned with or without a tier
    assert tiered.split()[-4:-1] == plain.split()[-4:-1] == ["2", "1", "7"]


CMA = TransferSelftest(9.853, 15.9, 0.6197, "nixl/UCX DRAM UCX_NET_DEVICES=lo UCX_TLS=any")
TCP = TransferSelftest(1.5, 15.0, 0.1, "nixl/UCX DRAM UCX_NET_DEVICES=lo UCX_TLS=tcp")
FAILED = TransferSelftest(0.0, 0.0, 0.0, "failed: timed out: a write did not complete")


def test_each_workers_transfer_self_test_is_shown():
    workers = [
        _worker("d1", "decode", CMA),
        _worker("d2", "decode", TCP),
        _worker("p1", "prefill", FAILED),
        _worker("p2", "prefill"),  # not run (--no-kv-transfer-selftest) or an older worker
    ]
    header, cma, tcp, failed, unknown = worker_table(workers)
    assert header.endswith("KV xfer GB/s (x memcpy)")
    assert cma.endswith("9.85 (0.62x)") and tcp.endswith("1.50 (0.10x)")
    assert failed.split()[-1] == "failed" and unknown.split()[-1] == "-"
    assert len({len(line) for line in (header, cma, tcp, failed, unknown)}) == 1
    assert selftest_notes(workers) == [
        "KV transfer self-test of d2: slow path, 1.50 GB/s = 0.10x memcpy over "
        "nixl/UCX DRAM UCX_NET_DEVICES=lo UCX_TLS=tcp (docs/kvtransfer.md)",
        "KV transfer self-test of p1 failed: timed out: a write did not complete",
    ]


def test_the_registration_carries_the_self_test_only_when_it_ran():
    import json

    ran, not_run = _worker("d1", "decode", CMA), _worker("p2", "prefill")
    assert json.loads(ran.to_json())["transfer_selftest"] == {
        "gbps": 9.853,
        "memcpy_gbps": 15.9,
        "ratio": 0.6197,
        "path": CMA.path,
    }
    assert "transfer_selftest" not in json.loads(not_run.to_json())
    assert WorkerInfo.from_json(ran.to_json()) == ran
    assert WorkerInfo.from_json(not_run.to_json()) == not_run


def test_pdserve_status_prints_the_self_tests(capsys):
    """`pdserve status --etcd ...` over a fake etcd holding two registrations."""
    import argparse
    import contextlib
    from unittest import mock

    from local_cluster.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["status", "--etcd", "127.0.0.1:1"])
    workers = [_worker("d1", "decode", CMA), _worker("p1", "prefill", FAILED)]

    @contextlib.asynccontextmanager
    async def client(endpoint, credentials):
        yield "client"

    async def listed(c, cluster):
        assert (c, cluster) == ("client", "default")
        return workers

    with (
        mock.patch("cluster.registration.make_client", client),
        mock.patch("cluster.registration.list_workers", listed),
    ):
        assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == worker_table(workers)[0]
    assert out[1].startswith("decode   d1") and out[1].endswith("9.85 (0.62x)")
    assert out[2].startswith("prefill  p1") and out[2].endswith("failed")
    assert out[3] == f"KV transfer self-test of p1 {FAILED.path}"
