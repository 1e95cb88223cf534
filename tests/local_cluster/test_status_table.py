"""`pdserve status`'s worker table (local_cluster/cli.py worker_table): a worker with a second
KV tier shows its used/total tier blocks, one without shows `-`; the columns stay aligned."""

from cluster.registration import Capacity, WorkerInfo
from local_cluster.cli import worker_table


def _worker(wid, role, **cap):
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
    assert tiered.split()[-3:] == plain.split()[-3:] == ["2", "1", "7"]
