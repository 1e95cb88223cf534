"""Request state machines (sender and receiver) through the in-process fake transport:
completion rules, validation, peers, metrics. The fake only replaces the transport, so this
is the bookkeeping NIXL runs too."""

import time

import pytest
import torch
from kv_fake_util import SHAPE, S, make, step
from prometheus_client import generate_latest

from kvtransfer import (
    BlockRangeError,
    DuplicateRequestError,
    FakeTransferBackend,
    IncompatiblePeerError,
    KVCompat,
    KVTransferConfig,
    KVTransferError,
    MetadataError,
    PoolError,
    RequestStateError,
    UnknownPeerError,
    wait_for,
)
from kvtransfer.polling import Backoff

pytestmark = pytest.mark.timeout(30)


def test_batches_land_byte_identical_and_complete_only_after_final(pd):
    p, ppool, d, dpool = pd
    before = dpool.clone()
    remote = [40, 3, 17, 29, 8, 44, 11, 0, 35, 22]
    local = [5, 6, 7, 8, 9, 20, 21, 22, 30, 31]
    pairs = list(zip(local, remote))
    d.receiver.expect("r1", remote, deadline=time.monotonic() + 5)
    for i in range(3):
        p.sender.send("r1", "D", pairs[3 * i : 3 * i + 3], final=False)
        assert step(p, d) == {}
    assert d.receiver.progress("r1") == (9, 10)
    assert p.sender.status("r1") is S.PENDING and d.receiver.status("r1") is S.PENDING
    p.sender.send("r1", "D", pairs[9:], final=True)
    results = step(p, d)
    assert results[("send", "r1")].status is S.COMPLETE
    assert results[("recv", "r1")].status is S.COMPLETE
    assert results[("recv", "r1")].peer == "P" and results[("recv", "r1")].num_blocks == 10
    for lo, re in pairs:
        assert torch.equal(dpool[re], ppool[lo])
    untouched = [b for b in range(48) if b not in remote]
    assert torch.equal(dpool[untouched], before[untouched])
    assert p.sender.num_active == 0 and d.receiver.num_active == 0
    assert p.sender.num_outstanding_writes == 0
    assert p.sender.status("r1") is None and d.receiver.status("r1") is None


def test_empty_final_batch_carries_the_total(pd):
    p, _, d, _ = pd
    d.receiver.expect("r", [1, 2])
    p.sender.send("r", "D", [(0, 1), (1, 2)], final=False)
    assert step(p, d) == {}
    p.sender.send("r", "D", [], final=True)
    results = step(p, d)
    assert results[("recv", "r")].status is S.COMPLETE
    assert results[("send", "r")].status is S.COMPLETE


def test_settle_is_the_time_from_the_last_post_to_completion(pd):
    """`settle_s`: the transport's acknowledgement after the last write was posted (the
    prefill worker's handover counts from that post: on one host its bytes have landed)."""
    p, _, d, _ = pd
    d.receiver.expect("r", [1, 2, 3])
    p.sender.send("r", "D", [(0, 1), (1, 2)], final=False)
    assert step(p, d) == {}
    time.sleep(0.2)  # long before the last post: not part of its settle
    p.sender.send("r", "D", [(2, 3)], final=True)
    time.sleep(0.05)  # the completion is seen only at the next poll
    result = step(p, d)[("send", "r")]
    assert result.status is S.COMPLETE
    assert 0.05 <= result.settle_s < 0.2 <= result.elapsed_s


@pytest.mark.parametrize(
    "pairs, message",
    [
        ([(32, 1)], "local block ids out of range"),
        ([(-1, 1)], "local block ids out of range"),
        ([(0, 48)], r"remote block ids out of range \[0, 48\): \[48\]"),
        ([(0, 1), (1, 1)], "same remote block twice"),
        ([(0.5, 1)], "must be integers"),
        ([(True, 1)], "must be integers"),
        ([(0, 1, 2)], "pairs"),
        ([0, 1], "pairs"),
    ],
)
def test_bad_block_ids_raise_and_write_nothing(pd, pairs, message):
    p, _, d, dpool = pd
    before = dpool.clone()
    with pytest.raises(BlockRangeError, match=message):
        p.sender.send("r", "D", pairs, final=True)
    assert p.sender.num_active == 0 and p.sender.num_outstanding_writes == 0
    step(p, d)
    assert torch.equal(dpool, before)


def test_receiver_refuses_bad_expectations(pd):
    _, _, d, _ = pd
    for ids, message in [
        ([48], "out of range"),
        ([-2], "out of range"),
        ([1, 1], "repeated"),
        (["a"], "integers"),
    ]:
        with pytest.raises(BlockRangeError, match=message):
            d.receiver.expect("r", ids)
    d.receiver.expect("r", [1, 2])
    with pytest.raises(DuplicateRequestError):
        d.receiver.expect("r", [3])
    with pytest.raises(BlockRangeError, match="already expected by request 'r'"):
        d.receiver.expect("r2", [2, 3])
    assert d.receiver.num_active == 1


def test_sender_request_rules(fabric, pd):
    p, _, d, _ = pd
    d2, _ = make(fabric, "D2", 8, seed=3)
    p.add_peer(d2.metadata())
    with pytest.raises(UnknownPeerError, match="unknown KV transfer peer 'X'"):
        p.sender.send("r", "X", [(0, 1)], final=True)
    p.sender.send("r", "D", [(0, 1)], final=False)
    with pytest.raises(BlockRangeError, match="twice"):
        p.sender.send("r", "D", [(2, 1)], final=False)
    with pytest.raises(RequestStateError, match="writes to 'D'"):
        p.sender.send("r", "D2", [(0, 2)], final=False)
    p.sender.send("r", "D", [(1, 2)], final=True)
    with pytest.raises(RequestStateError, match="final"):
        p.sender.send("r", "D", [(2, 3)], final=True)
    assert p.sender.num_active == 1


def test_add_peer_checks(fabric, pd):
    p, _, d, _ = pd
    assert p.add_peer(d.metadata()) == "D"  # idempotent
    other, _ = make(fabric, "O", 8, seed=5, model="other-model")
    with pytest.raises(IncompatiblePeerError, match="model_id: ours='m' theirs='other-model'"):
        p.add_peer(other.metadata().to_bytes())
    with pytest.raises(MetadataError, match="our own agent name"):
        p.add_peer(p.metadata())
    with pytest.raises(MetadataError, match="not valid JSON"):
        p.add_peer(b"\x00garbage")
    nixl_like = d.metadata().to_bytes().replace(b'"backend":"fake"', b'"backend":"nixl"')
    with pytest.raises(MetadataError, match="uses backend 'nixl'"):
        p.add_peer(nixl_like)
    assert sorted(p.peers()) == ["D"]


def test_pool_registration_rules(fabric):
    b = FakeTransferBackend(fabric, KVTransferConfig(agent_name="X"))
    with pytest.raises(PoolError, match="register_pool first"):
        b.metadata()
    assert b.sender.poll() == [] and b.receiver.poll() == []  # a loop may start early
    with pytest.raises(PoolError, match="register_pool first"):
        b.receiver.expect("r", [0])
    pool = torch.zeros(4, *SHAPE)
    with pytest.raises(PoolError, match="shape"):
        b.register_pool(pool, KVCompat("m", "float32", 8, 2, 2, 8))
    b.register_pool(pool, KVCompat.for_pool(pool, "m"))
    with pytest.raises(PoolError, match="already registered"):
        b.register_pool(pool, KVCompat.for_pool(pool, "m"))
    b.close()
    b.close()
    with pytest.raises(KVTransferError, match="closed"):
        b.receiver.poll()


def test_many_interleaved_requests(fabric):
    d, dpool = make(fabric, "D", 64, seed=2)
    senders = [make(fabric, f"P{i}", 16, seed=10 + i) for i in range(3)]
    for s, _ in senders:
        s.add_peer(d.metadata())
    plan = {}
    free = iter(torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist())
    for i in range(9):
        plan[f"r{i}"] = (i % 3, [(j, next(free)) for j in range(6)])
        d.receiver.expect(f"r{i}", [rb for _, rb in plan[f"r{i}"][1]])
    for k in range(3):
        for rid, (si, pairs) in plan.items():
            senders[si][0].sender.send(rid, d.agent_name, pairs[2 * k : 2 * k + 2], final=k == 2)
    results = step(*(s for s, _ in senders), d)
    assert {rid for kind, rid in results if kind == "recv"} == set(plan)
    assert all(r.status is S.COMPLETE for r in results.values())
    for rid, (si, pairs) in plan.items():
        for lo, re in pairs:
            assert torch.equal(dpool[re], senders[si][1][lo])


def test_metrics_per_peer(pd):
    p, _, d, _ = pd
    bb = d.metadata().block_bytes
    d.receiver.expect("ok", [1, 2, 3])
    p.sender.send("ok", "D", [(0, 1), (1, 2)], final=False)
    p.sender.send("ok", "D", [(2, 3)], final=True)
    d.receiver.expect("late", [9], deadline=time.monotonic())
    step(p, d)
    sm, rm = p.sender.metrics.peers["D"], d.receiver.metrics.peers["P"]
    assert (sm.bytes, sm.blocks, sm.batches, sm.requests_completed) == (3 * bb, 3, 2, 1)
    assert (rm.bytes, rm.blocks, rm.batches, rm.requests_completed) == (3 * bb, 3, 2, 1)
    assert sm.batch_latency_s.count == 2 and sm.request_latency_s.count == 1
    assert d.receiver.metrics.peers["unknown"].failures == {"timeout": 1}
    snap = p.sender.metrics.snapshot()
    assert snap["direction"] == "send" and snap["peers"]["D"]["bytes"] == 3 * bb
    exported = generate_latest(d.receiver.metrics.registry).decode()
    assert 'pdserve_kv_transfer_blocks_total{direction="receive",peer="P"} 3.0' in exported


def test_wait_for_returns_every_result_and_backs_off(pd):
    p, _, d, _ = pd
    for rid, b in [("a", 1), ("b", 2)]:
        d.receiver.expect(rid, [b])
        p.sender.send(rid, "D", [(0, b)], final=True)
    results = wait_for(d.receiver, ["a"], 2, also_poll=p.sender.poll)
    assert set(results) == {"a", "b"}
    t0 = time.monotonic()
    assert wait_for(d.receiver, ["never"], 0.05) == {}
    assert 0.05 <= time.monotonic() - t0 < 1
    backoff = Backoff(min_s=0.001, max_s=0.004)
    t0 = time.monotonic()
    for _ in range(4):
        backoff.sleep()
    assert time.monotonic() - t0 >= 0.001 + 0.002 + 0.004 + 0.004


def test_a_pool_reallocated_after_sleep_is_registered_again(pd):
    """Sleep mode: the decode worker deregisters its pool before freeing it and registers the
    reallocated one (new address: new metadata); the prefill side reconnects on the new
    metadata and writes land in the new pool."""
    p, ppool, d, dpool = pd
    old = d.metadata()
    compat = old.compat
    d.deregister_pool()
    with pytest.raises(PoolError):
        d.metadata()
    d.deregister_pool()  # idempotent
    fresh = torch.zeros_like(dpool)
    meta = d.register_pool(fresh, compat)
    assert meta.base_addr == fresh.data_ptr() != old.base_addr
    assert p.add_peer(meta.to_bytes()) == "D"
    d.receiver.expect("r1", [3, 4], deadline=time.monotonic() + 5)
    p.sender.send("r1", "D", [(1, 3), (2, 4)], final=True)
    results = step(p, d)
    assert results[("recv", "r1")].status is S.COMPLETE
    assert torch.equal(fresh[3], ppool[1]) and torch.equal(fresh[4], ppool[2])
