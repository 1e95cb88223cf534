"""NIXL between real processes on loopback: bytes, concurrency, and peers dying mid-transfer.

This process hosts one side (its own NixlTransferBackend) and child processes (kv_peer.py)
the other, so every transfer crosses a process boundary. Children are killed only by pid.
"""

import hashlib
import os
import signal
import time

import pytest
import torch
from kv_peer import MODEL, PeerProcess, block_digest, make_pool

from kvtransfer import KVCompat, KVTransferConfig, NixlTransferBackend, TransferStatus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]
S = TransferStatus


def local_backend(name, num_blocks, seed):
    pool = make_pool(num_blocks, seed)
    backend = NixlTransferBackend(KVTransferConfig(agent_name=f"{name}-{os.getpid()}"))
    backend.register_pool(pool, KVCompat.for_pool(pool, MODEL))
    return backend, pool


class Loop:
    """Engine loops of backends living in this process: poll them all, keep every result
    (each is reported once), until the wanted request ids have results."""

    def __init__(self, *backends):
        self.backends, self.sent, self.recv = backends, {}, {}

    def run(self, timeout_s=20.0, want_send=(), want_recv=()):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for b in self.backends:
                self.sent.update((r.request_id, r) for r in b.sender.poll())
                self.recv.update((r.request_id, r) for r in b.receiver.poll())
            if (
                (want_send or want_recv)
                and set(want_send) <= self.sent.keys()
                and set(want_recv) <= self.recv.keys()
            ):
                break
            time.sleep(0.0005)
        return self


@pytest.fixture(scope="module")
def peers():
    """Child processes, started together (they import torch and NIXL in parallel)."""
    procs = {
        "recv": PeerProcess.start("child-recv", num_blocks=512, seed=11),
        "victim-recv": PeerProcess.start("child-victim-recv", num_blocks=64, seed=12),
        "send-a": PeerProcess.start("child-send-a", num_blocks=128, seed=13),
        "victim-send": PeerProcess.start("child-victim-send", num_blocks=64, seed=14),
        "hang-recv": PeerProcess.start("child-hang-recv", num_blocks=16, seed=15),
    }
    try:
        for p in procs.values():
            p.ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def test_hundreds_of_blocks_in_batches_to_scattered_ids_are_byte_identical(peers):
    child = peers["recv"]
    p, ppool = local_backend("sender-bytes", 400, seed=21)
    try:
        name = p.add_peer(child.metadata)
        g = torch.Generator().manual_seed(5)
        remote = torch.randperm(512, generator=g)[:300].tolist()
        local = torch.randperm(400, generator=g)[:300].tolist()
        child.call("expect", "bytes", remote, 30.0)
        pairs = list(zip(local, remote))
        loop = Loop(p)
        for i in range(0, 300, 40):  # 8 batches, the last one final
            p.sender.send("bytes", name, pairs[i : i + 40], final=i + 40 >= 300)
            loop.run(timeout_s=0.002)  # an engine step between batches
        sent = loop.run(want_send=["bytes"]).sent
        assert sent["bytes"].status is S.COMPLETE, sent["bytes"]
        got = child.call("wait", ["bytes"], 20.0)["bytes"]
        assert got["status"] == "COMPLETE" and got["blocks"] == 300, got
        assert child.call("digest", remote) == block_digest(ppool, local)
        untouched = sorted(set(range(512)) - set(remote))
        original = make_pool(512, seed=11)
        assert child.call("digest", untouched) == block_digest(original, untouched)
        assert p.sender.num_outstanding_writes == 0 and p.sender.num_active == 0
        m = p.sender.metrics.peers[name]
        assert m.blocks == 300 and m.batches == 8 and m.requests_completed == 1
    finally:
        p.close()


def test_concurrent_requests_from_two_senders_to_one_receiver(peers):
    child = peers["send-a"]
    d, dpool = local_backend("receiver-concurrent", 256, seed=22)
    p, ppool = local_backend("sender-concurrent", 128, seed=23)
    try:
        child.call("add_peer", d.metadata().to_bytes())
        p.add_peer(d.metadata())
        child_pool = make_pool(128, seed=13)
        free = iter(torch.randperm(256, generator=torch.Generator().manual_seed(6)).tolist())
        plan = {f"c{i}": [(j + 8 * (i // 2), next(free)) for j in range(8)] for i in range(12)}
        for rid, pairs in plan.items():
            d.receiver.expect(rid, [r for _, r in pairs], deadline=time.monotonic() + 30)
        loop = Loop(d, p)
        for k in range(4):  # interleave batches of every request, alternating senders
            for i, (rid, pairs) in enumerate(plan.items()):
                batch, final = pairs[2 * k : 2 * k + 2], k == 3
                if i % 2:
                    child.call("send", rid, d.agent_name, batch, final)
                else:
                    p.sender.send(rid, d.agent_name, batch, final=final)
            loop.run(timeout_s=0.002)
        local_rids = [r for i, r in enumerate(plan) if i % 2 == 0]
        loop.run(want_send=local_rids, want_recv=plan)
        sent_local, recv = loop.sent, loop.recv
        assert all(recv[rid].status is S.COMPLETE for rid in plan), recv
        assert {recv[rid].peer for rid in plan} == {p.agent_name, "child-send-a"}
        for i, (rid, pairs) in enumerate(plan.items()):
            src = child_pool if i % 2 else ppool
            assert torch.equal(dpool[[r for _, r in pairs]], src[[lo for lo, _ in pairs]]), rid
        assert all(r.status is S.COMPLETE for r in sent_local.values())
        child_results = child.call("wait", [r for i, r in enumerate(plan) if i % 2], 10.0)
        assert all(r["status"] == "COMPLETE" for r in child_results.values()), child_results
    finally:
        p.close()
        d.close()


def test_receiver_dies_mid_transfer(peers):
    victim, survivor = peers["victim-recv"], peers["recv"]
    p, ppool = local_backend("sender-victim", 64, seed=24)
    try:
        dead = p.add_peer(victim.metadata)
        alive = p.add_peer(survivor.metadata)
        victim.call("expect", "v1", [1, 2, 3, 4], 60.0)
        victim.call("expect", "v2", [10, 11], 60.0)
        p.sender.send("v1", dead, [(0, 1), (1, 2)], final=False)
        p.sender.send("v2", dead, [(5, 10)], final=False)
        loop = Loop(p).run(timeout_s=0.2)
        assert p.sender.num_outstanding_writes == 0  # first batches delivered
        victim.kill()
        t0 = time.monotonic()
        p.sender.send("v1", dead, [(2, 3), (3, 4)], final=True)
        sent = loop.run(want_send=["v1", "v2"], timeout_s=10).sent
        assert time.monotonic() - t0 < 5
        assert sent["v1"].status is S.ERROR and "disconnect" in sent["v1"].error, sent["v1"]
        assert sent["v2"].status is S.ERROR, sent["v2"]
        assert p.sender.num_active == 0 and p.sender.num_outstanding_writes == 0
        assert p.sender.metrics.peers[dead].failures.get("error") == 2
        # The sender keeps serving other peers.
        survivor.call("expect", "after-death", [500, 501], 20.0)
        p.sender.send("after-death", alive, [(7, 500), (8, 501)], final=True)
        sent = loop.run(want_send=["after-death"]).sent
        assert sent["after-death"].status is S.COMPLETE
        assert survivor.call("wait", ["after-death"], 10.0)["after-death"]["status"] == "COMPLETE"
        assert survivor.call("digest", [500, 501]) == block_digest(ppool, [7, 8])
    finally:
        p.close()


def test_sender_dies_mid_transfer(peers):
    victim = peers["victim-send"]
    d, dpool = local_backend("receiver-victim", 64, seed=25)
    try:
        victim.call("add_peer", d.metadata().to_bytes())
        t0 = time.monotonic()
        d.receiver.expect("s1", [20, 21, 22, 23], deadline=t0 + 2.0)
        victim.call("send", "s1", d.agent_name, [(0, 20), (1, 21)], False)
        end = time.monotonic() + 5
        while d.receiver.progress("s1")[0] < 2 and time.monotonic() < end:
            assert d.receiver.poll() == []
            time.sleep(0.001)
        assert d.receiver.progress("s1") == (2, 4)
        victim.kill()
        seen = []
        while not seen:
            seen = d.receiver.poll()
            assert d.receiver.status("s1") in (S.PENDING, S.TIMEOUT, None)
            time.sleep(0.002)
        (res,) = seen
        assert res.status is S.TIMEOUT and res.num_blocks == 2, res
        assert 2.0 <= time.monotonic() - t0 < 4.0
        assert d.receiver.num_active == 0
        src = make_pool(64, seed=14)
        assert torch.equal(dpool[[20, 21]], src[[0, 1]])  # landed, but never reported complete
        assert (
            hashlib.sha256(dpool[22].numpy().tobytes()).hexdigest()
            == block_digest(make_pool(64, seed=25), [22])[0]
        )
    finally:
        d.close()


def test_hung_receiver_fails_pending_writes_at_the_sender_deadline(peers):
    """A receiver that stops progressing (SIGSTOP) leaves the batch's flush/notification
    pending: the sender ends the request at its deadline and releases every handle."""
    hung = peers["hang-recv"]
    p, _ = local_backend("sender-hang", 16, seed=26)
    try:
        name = p.add_peer(hung.metadata)
        hung.call("expect", "h1", [1, 2], 60.0)
        os.kill(hung.process.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            p.sender.send("h1", name, [(0, 1), (1, 2)], final=True, deadline=t0 + 1.0)
            sent = Loop(p).run(want_send=["h1"], timeout_s=10).sent
            assert sent["h1"].status is S.TIMEOUT, sent["h1"]
            assert 1.0 <= time.monotonic() - t0 < 3.0
            assert p.sender.num_active == 0
            end = time.monotonic() + 5
            while p.sender.num_outstanding_writes and time.monotonic() < end:
                p.sender.poll()
                time.sleep(0.01)
            assert p.sender.num_outstanding_writes == 0
        finally:
            os.kill(hung.process.pid, signal.SIGCONT)
        hung.call("expect", "h2", [5], 20.0)  # the link works again once it resumes
        p.sender.send("h2", name, [(3, 5)], final=True)
        assert Loop(p).run(want_send=["h2"]).sent["h2"].status is S.COMPLETE
        assert hung.call("wait", ["h2"], 10.0)["h2"]["status"] == "COMPLETE"
    finally:
        p.close()
