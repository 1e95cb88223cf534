"""The KV transfer self-test (kvtransfer/selftest.py): against the real NIXL backend on one
host it measures a positive rate and leaves the worker's agent as it found it (its peers, its
loaded remote agents, no write handle, its pool's bytes), and runs again; against the fake it
names the fake path; a write that never completes, a temporary agent that cannot be made, or
a backend without a pool is a 'failed: ...' result with everything released."""

import os

import pytest
import torch

from kvtransfer import (
    FakeFabric,
    FakeTransferBackend,
    KVCompat,
    KVTransferConfig,
    NixlTransferBackend,
    TransferStatus,
    run_selftest,
    wait_for,
)
from kvtransfer.selftest import describe_path, nixl_peer
from kvtransfer.ucx_proto_info import ucx_write_transports

pytestmark = pytest.mark.timeout(60)

SHAPE = (3, 2, 2, 16, 64)  # kv heads, layers, K/V, block_size, head_dim: 48 KiB fp32 blocks
_count = iter(range(1000))


def _nixl(blocks, seed):
    name = f"selftest-{os.getpid()}-{next(_count)}"
    pool = torch.randn((blocks, *SHAPE), generator=torch.Generator().manual_seed(seed))
    backend = NixlTransferBackend(KVTransferConfig(agent_name=name))
    backend.register_pool(pool, KVCompat.for_pool(pool, "m"))
    return backend, pool


def _fake(fabric, name, blocks=64):
    pool = torch.randn((blocks, *SHAPE), generator=torch.Generator().manual_seed(1))
    backend = FakeTransferBackend(fabric, KVTransferConfig(agent_name=name))
    backend.register_pool(pool, KVCompat.for_pool(pool, "m"))
    return backend, pool


def _by_id(side):
    return {r.request_id: r for r in side.poll()}


def test_nixl_self_test_measures_and_leaves_the_worker_agent_as_it_was():
    w, pool = _nixl(256, seed=1)
    d, dpool = _nixl(16, seed=2)
    try:
        w.add_peer(d.metadata())
        before = pool.clone()
        loaded = set(w.transport._remote)
        for _ in range(2):  # a second run works: nothing of the first is in the way
            r = run_selftest(w, pool, nixl_peer, target_bytes=1 << 20)
            assert r.ok, r.path
            assert r.gbps > 0 and r.memcpy_gbps > 0
            assert r.ratio == pytest.approx(r.gbps / r.memcpy_gbps)
            assert r.num_bytes == 22 * pool[0].numel() * 4  # 1 MiB in whole 48 KiB blocks
            # UCX's own word for the path (one host: CMA), and the settings it ran with.
            assert r.path == describe_path("nixl", "DRAM", transports=["cma/memory"])
            assert "UCX_NET_DEVICES=lo" in r.path and "UCX_TLS=" in r.path
            assert r.line().startswith(f"KV transfer self-test: {r.gbps:.2f} GB/s = ")
            assert w.peers() == [d.agent_name]
            assert set(w.transport._remote) == loaded  # the temporary agent was unloaded
            assert w.sender.num_active == 0 and w.sender.num_outstanding_writes == 0
            assert w.sender.metrics.peers == {}  # not a transfer of the worker's
        assert torch.equal(pool, before)  # read only
        # The worker's real peer still works after the self-test.
        d.receiver.expect("r", [3])
        w.sender.send("r", d.agent_name, [(5, 3)], final=True)
        sent: dict = {}
        got = wait_for(d.receiver, ["r"], 10, also_poll=lambda: sent.update(_by_id(w.sender)))
        sent.update(wait_for(w.sender, ["r"], 10) if "r" not in sent else {})
        assert got["r"].status is sent["r"].status is TransferStatus.COMPLETE, (got, sent)
        assert torch.equal(dpool[3], pool[5])
    finally:
        w.close()
        d.close()


def test_ucx_over_tcp_is_named_and_its_protocol_tables_stay_out_of_stderr(monkeypatch, capfd):
    monkeypatch.setenv("UCX_TLS", "tcp")  # read by every agent made from now on
    w, pool = _nixl(64, seed=4)
    try:
        capfd.readouterr()
        r = run_selftest(w, pool, nixl_peer, target_bytes=1 << 20)
        assert r.ok and " writes over tcp/lo (" in r.path and "UCX_TLS=tcp" in r.path, r
        assert "remote memory write" not in capfd.readouterr().err  # captured, not printed
        assert "UCX_PROTO_INFO" not in os.environ
    finally:
        w.close()


UCX_TABLES = """\
[1796681183.5] [vm:5285 :0]   +--------+-------------+-----------------------------------+
[1796681183.5] [vm:5285 :0]   | b self cfg#0                                             |
[1796681183.5] [vm:5285 :0]   | remote memory write by ucp_put* from host memory to host |
[1796681183.5] [vm:5285 :0]   +--------+-------------+-----------------------------------+
[1796681183.5] [vm:5285 :0]   | Range  | Description |              Config               |
[1796681183.5] [vm:5285 :0]   +--------+-------------+-----------------------------------+
[1796681183.5] [vm:5285 :0]   | 0..inf | zero-copy   | self/memory                       |
[1796681183.5] [vm:5285 :0]   +--------+-------------+-----------------------------------+
[1796681183.6] [vm:5285 :0]   | b intra-node cfg#1                                       |
[1796681183.6] [vm:5285 :0]   | active message by ucp_am_send* from host memory |
[1796681183.6] [vm:5285 :0]   | Range  | Description |              Config               |
[1796681183.6] [vm:5285 :0]   |          0 | short              | tcp/lo        |
[1796681183.6] [vm:5285 :0]   | b intra-node cfg#1                                       |
[1796681183.6] [vm:5285 :0]   | remote memory write by ucp_put* from host memory to host |
[1796681183.6] [vm:5285 :0]   | Range  | Description |              Config               |
[1796681183.6] [vm:5285 :0]   | 0..8k | short   | cma/memory                        |
[1796681183.6] [vm:5285 :0]   | 8k..inf | zero-copy   | rc_mlx5/mlx5_0:1                        |
[1796681183.7] [vm:5285 :0]   | b intra-node cfg#1                                       |
[1796681183.7] [vm:5285 :0]   | remote memory write by ucp_put*(multi) from host memory to host |
[1796681183.7] [vm:5285 :0]   | Range  | Description |              Config               |
[1796681183.7] [vm:5285 :0]   | 0..inf | zero-copy   | cma/memory                        |
"""


def test_the_write_transports_are_read_from_ucx_protocol_tables():
    """Only 'remote memory write' tables of endpoints to other agents count (not 'self', not
    the active messages that carry notifications); each transport once, in order."""
    assert ucx_write_transports(UCX_TABLES) == ["cma/memory", "rc_mlx5/mlx5_0:1"]
    assert ucx_write_transports("no tables here\n") == []


def test_a_pool_smaller_than_the_target_is_measured_whole():
    w, pool = _nixl(4, seed=3)
    try:
        r = run_selftest(w, pool, nixl_peer)
        assert r.ok and r.num_bytes == pool.numel() * 4, r
    finally:
        w.close()


def test_fake_backend_reports_the_fake_path_by_name():
    fabric = FakeFabric()
    w, pool = _fake(fabric, "W")
    d, _ = _fake(fabric, "D")
    w.add_peer(d.metadata())
    r = run_selftest(w, pool, lambda cfg: FakeTransferBackend(fabric, cfg), target_bytes=1 << 20)
    assert r.ok and r.gbps > 0, r
    assert r.path.startswith("fake (in-process torch copy, DRAM") and "not a real" in r.path
    assert set(fabric.agents) == {"W", "D"} and w.peers() == ["D"]


def test_a_write_that_never_completes_fails_within_the_budget_and_releases_everything():
    fabric = FakeFabric()
    w, pool = _fake(fabric, "W")
    made = []

    def stalled_peer(cfg):
        peer = FakeTransferBackend(fabric, cfg)
        fabric.stall(peer.agent_name)  # its writes stay in flight: a hung link
        made.append(peer.agent_name)
        return peer

    r = run_selftest(w, pool, stalled_peer, budget_s=0.2)
    assert not r.ok and r.path.startswith("failed: timed out"), r
    assert (r.gbps, r.ratio) == (0.0, 0.0)
    assert r.line() == f"KV transfer self-test {r.path}"
    assert made and set(fabric.agents) == {"W"}  # the temporary agent is closed
    assert w.transport.released_handles == 1  # the write in flight was cancelled
    assert w.peers() == [] and w.transport._peers == set()


def test_a_temporary_agent_that_cannot_be_made_is_a_failed_result():
    fabric = FakeFabric()
    w, pool = _fake(fabric, "W")

    def broken(cfg):
        raise RuntimeError("no UCX here")

    r = run_selftest(w, pool, broken)
    assert not r.ok and r.path == "failed: RuntimeError: no UCX here"
    assert set(fabric.agents) == {"W"}


def test_a_backend_without_a_pool_is_a_failed_result():
    fabric = FakeFabric()
    w = FakeTransferBackend(fabric, KVTransferConfig(agent_name="W"))
    pool = torch.zeros((4, *SHAPE))
    r = run_selftest(w, pool, lambda cfg: FakeTransferBackend(fabric, cfg))
    assert not r.ok and "register_pool" in r.path, r
    assert set(fabric.agents) == {"W"}


def test_a_tensor_parallel_rank_zero_is_measured_between_temporary_agents():
    """Rank 0 of a tensor-parallel worker writes in parts through its group: the self-test
    leaves its agent alone and measures two temporary agents with its settings instead."""
    from kvtransfer.fake import FakeTransport
    from kvtransfer.heads import HeadRange

    class RankZero(FakeTransport):
        @property
        def heads(self):
            return HeadRange(0, SHAPE[0])

    fabric = FakeFabric()
    w, pool = _fake(fabric, "W")
    w.transport.__class__ = RankZero
    made = []

    def peer(cfg):
        made.append(cfg.agent_name)
        return FakeTransferBackend(fabric, cfg)

    r = run_selftest(w, pool, peer, target_bytes=1 << 20)
    assert r.ok and r.path.endswith(
        "(between temporary agents: tensor-parallel workers write in parts)"
    )
    assert [n.startswith("W.selftest-") for n in made] == [True, True] and made[0].endswith("-src")
    assert set(fabric.agents) == {"W"} and w.transport._peers == set()
    assert w.transport.released_handles == 0  # nothing was posted by the worker's agent


def test_bytes_that_did_not_land_fail_the_test_even_from_an_all_zero_pool():
    """A worker's pool at start is all zeros: a write that moved nothing into a zeroed scratch
    pool would look right. The scratch pool is filled with another pattern first."""

    class Misplaced(FakeTransferBackend):  # its writes land in a copy, not in the scratch
        def register_pool(self, kv_cache, compat):
            return super().register_pool(kv_cache.clone(), compat)

    fabric = FakeFabric()
    pool = torch.zeros((16, *SHAPE))
    w = FakeTransferBackend(fabric, KVTransferConfig(agent_name="W"))
    w.register_pool(pool, KVCompat.for_pool(pool, "m"))
    r = run_selftest(w, pool, lambda cfg: Misplaced(fabric, cfg))
    assert r.path == "failed: the bytes that landed differ from the bytes sent", r
    assert set(fabric.agents) == {"W"} and w.transport._peers == set()
