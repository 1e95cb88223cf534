"""Block-hash agreement: the probe is a fingerprint of the hashing under a worker's settings,
a starting worker refuses a cluster whose workers of its layout publish another probe (before
registering anything), and a registration's probe is checked against this process's."""

import asyncio
import dataclasses

import pytest

from cluster.block_hash_agreement import BlockHashMismatch, check_peers, probe_refusal
from cluster.etcd_server import EtcdServer
from cluster.registration import (
    Registrar,
    RegistrationRefused,
    WorkerInfo,
    list_workers,
    make_client,
)
from engine.kv import block_hash
from engine.kv.block_hash import block_hash_probe

WRONG = "0123456789abcdef"


def worker(wid, probe=None, compat="c", version=0, block_size=16, kv="auto"):
    if probe is None:
        probe = block_hash_probe(block_size, kv, version)
    return WorkerInfo(
        wid,
        "decode",
        f"127.0.0.1:{len(wid)}",
        "m",
        compat,
        block_size,
        kv_cache_dtype=kv,
        weights_version=version,
        block_hash_probe=probe,
    )


def test_probe_follows_every_hash_input_and_the_hashing_code(monkeypatch):
    p = block_hash_probe(16)
    assert len(p) == 16 and p == block_hash_probe(16)  # stable
    others = {
        block_hash_probe(32),
        block_hash_probe(16, "fp8_e4m3"),
        block_hash_probe(16, "auto", 1),
    }
    assert p not in others and len(others) == 3
    # Another hashing (here: another root, as a changed hash version would have) -> another probe.
    block_hash_probe.cache_clear()
    monkeypatch.setattr(block_hash, "_ROOT", b"pdserve-block-hash-v2")
    assert block_hash_probe(16) != p
    block_hash_probe.cache_clear()
    monkeypatch.undo()
    assert block_hash_probe(16) == p


def test_startup_check_names_the_other_worker_and_both_probes():
    own = worker("new")
    with pytest.raises(BlockHashMismatch) as exc:
        check_peers(own, [worker("old-1"), worker("old-2", probe=WRONG)])
    text = str(exc.value)
    assert "old-2" in text and WRONG in text and own.block_hash_probe in text
    assert isinstance(exc.value, RegistrationRefused)


def test_startup_check_compares_only_workers_of_the_same_layout_and_weights():
    own = worker("new")
    check_peers(
        own,
        [
            worker("other-layout", probe=WRONG, compat="c2"),
            worker("other-weights", probe=WRONG, version=3),
            worker("before-probes", probe=""),  # an older worker publishes none
            dataclasses.replace(own, block_hash_probe=WRONG),  # itself (an old registration)
            worker("agrees"),
        ],
    )


def test_router_side_recomputes_the_probe_for_the_registration_settings():
    assert probe_refusal(worker("ok")) is None
    assert probe_refusal(worker("ok-fp8", kv="fp8_e4m3", version=2, block_size=32)) is None
    assert probe_refusal(worker("old", probe="")) is None
    why = probe_refusal(worker("bad", probe=WRONG))
    assert WRONG in why and block_hash_probe(16) in why and "block size 16" in why
    # A probe computed for other settings than the ones published is refused too.
    assert probe_refusal(worker("mixed", probe=block_hash_probe(16, "auto", 1))) is not None


def test_registrar_refuses_to_register_next_to_a_disagreeing_worker():
    async def main(etcd):
        first = Registrar(etcd.endpoint, "t", lambda: worker("w1", probe=WRONG), ttl_s=2)
        await first.start()
        second = Registrar(
            etcd.endpoint, "t", lambda: worker("w2"), ttl_s=2, startup_check=check_peers
        )
        with pytest.raises(BlockHashMismatch, match="w1"):
            await second.start(timeout_s=30)  # refused at once, not retried until the deadline
        async with make_client(etcd.endpoint) as c:
            assert [w.worker_id for w in await list_workers(c, "t")] == ["w1"]
        await first.deregister()
        await second.start(timeout_s=5)  # alone now: registers
        await second.deregister()

    with EtcdServer() as etcd:
        asyncio.run(asyncio.wait_for(main(etcd), 20))
