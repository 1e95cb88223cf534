"""NIXL between two emulated hosts: a sender in namespace P, a receiver in namespace D, UCX
on TCP over the veth pair between them (UCX_TLS=tcp: on one kernel UCX would otherwise pick
CMA even across namespaces, and nothing would cross the link).

What proves the KV crossed the link: the veth's kernel byte counters grew by at least the
blocks' bytes, and UCX's own protocol report (UCX_PROTO_INFO) names `tcp/<veth>` as the only
transport of the sender's remote writes."""

import time

import pytest
import torch
from kv_peer import SHAPE, block_digest, make_pool
from netns_kv import start_peer, write_transports
from netns_util import netem, netem_unavailable, packet_loss, rate_limit, two_hosts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
BLOCK_BYTES = 4 * torch.Size(SHAPE).numel()
P_BLOCKS, D_BLOCKS = 256, 512


@pytest.fixture(scope="module")
def link(tmp_path_factory):
    logs = tmp_path_factory.mktemp("netns-kv")
    with two_hosts() as hosts:
        peers = {}
        try:
            peers["d"] = start_peer(hosts.decode, "netns-recv", D_BLOCKS, 31, logs)
            peers["p"] = start_peer(
                hosts.prefill, "netns-send", P_BLOCKS, 32, logs, default_timeout_s=1.0
            )
            for child in peers.values():
                child.ready()
            peer = peers["p"].call("add_peer", peers["d"].metadata)
            yield hosts, peers["p"], peers["d"], peer, logs
        finally:
            for child in peers.values():
                child.stop()


def _transfer(sender, receiver, peer, rid, n, seed, batch=32, timeout_s=20.0):
    """n scattered blocks P -> D in batches of `batch`; (sender result, receiver result,
    local ids, remote ids)."""
    g = torch.Generator().manual_seed(seed)
    local = torch.randperm(P_BLOCKS, generator=g)[:n].tolist()
    remote = torch.randperm(D_BLOCKS, generator=g)[:n].tolist()
    receiver.call("expect", rid, remote, timeout_s)
    pairs = list(zip(local, remote))
    for i in range(0, n, batch):
        sender.call("send", rid, peer, pairs[i : i + batch], i + batch >= n)
    sent = sender.call("wait", [rid], timeout_s + 5)[rid]
    got = receiver.call("wait", [rid], timeout_s + 5)[rid]
    return sent, got, local, remote


def test_blocks_cross_the_veth_over_tcp_byte_identical(link):
    hosts, sender, receiver, peer, logs = link
    tx0, rx0 = hosts.prefill.link_bytes()[0], hosts.decode.link_bytes()[1]
    sent, got, local, remote = _transfer(sender, receiver, peer, "bytes", 200, seed=1)
    assert sent["status"] == "COMPLETE" and got["status"] == "COMPLETE", (sent, got)
    assert got["blocks"] == 200
    assert receiver.call("digest", remote) == block_digest(make_pool(P_BLOCKS, 32), local)
    untouched = sorted(set(range(D_BLOCKS)) - set(remote))
    assert receiver.call("digest", untouched) == block_digest(make_pool(D_BLOCKS, 31), untouched)
    payload = 200 * BLOCK_BYTES
    assert hosts.prefill.link_bytes()[0] - tx0 >= payload
    assert hosts.decode.link_bytes()[1] - rx0 >= payload
    assert write_transports((logs / "netns-send.log").read_text()) == {f"tcp/{hosts.prefill.dev}"}


def _lossy_transfer_completes(link, rid, seed):
    hosts, sender, receiver, peer, _ = link
    t0 = time.monotonic()
    sent, got, local, remote = _transfer(sender, receiver, peer, rid, 120, seed=seed, batch=8)
    assert sent["status"] == "COMPLETE" and got["status"] == "COMPLETE", (sent, got)
    assert receiver.call("digest", remote) == block_digest(make_pool(P_BLOCKS, 32), local)
    assert sender.call("stats") == {"outstanding": 0, "send_active": 0, "recv_active": 0}
    return time.monotonic() - t0


def test_packet_loss_on_the_link_is_retransmitted_byte_identical(link):
    """1% of the packets dropped each way (nftables): TCP retransmits, every byte lands."""
    with packet_loss(link[0], 1) as dropped:
        _lossy_transfer_completes(link, "lossy", seed=2)
        assert dropped() > 0


def test_netem_delay_and_loss_still_complete_byte_identical(link):
    reason = netem_unavailable(link[0])
    if reason:
        pytest.skip(reason)
    with netem(link[0], "delay 20ms loss 1%"):
        assert _lossy_transfer_completes(link, "netem", seed=5) >= 0.04  # a delayed round trip


def test_transfer_slowed_past_its_deadlines_fails_cleanly_then_the_link_recovers(link):
    """A 4 Mbit/s link (tbf): 16 blocks (1.5 MiB) need 3 s, past the sender's 1 s deadline and
    the receiver's 0.5 s one. Both report TIMEOUT, no write handle stays outstanding, and
    once the link is fast again the next request completes."""
    hosts, sender, receiver, peer, _ = link
    with rate_limit(hosts, "4mbit"):
        t0 = time.monotonic()
        sent, got, _, _ = _transfer(sender, receiver, peer, "late", 16, seed=3, timeout_s=0.5)
        assert time.monotonic() - t0 < 5
    assert got["status"] == "TIMEOUT", got
    assert sent["status"] == "TIMEOUT", sent
    end = time.monotonic() + 10  # handles of the cancelled writes are released as they end
    while sender.call("stats")["outstanding"] and time.monotonic() < end:
        time.sleep(0.1)
    assert sender.call("stats") == {"outstanding": 0, "send_active": 0, "recv_active": 0}
    assert receiver.call("stats")["recv_active"] == 0
    # The link recovers: a later request completes. TCP may still be backing off from the
    # throttled writes for a moment (seen under load), so up to 3 tries, 5 s each.
    for attempt in range(3):
        sent, got, local, remote = _transfer(
            sender, receiver, peer, f"after-{attempt}", 16, seed=4 + attempt, timeout_s=5.0
        )
        if sent["status"] == "COMPLETE" and got["status"] == "COMPLETE":
            break
        time.sleep(1)
    assert sent["status"] == "COMPLETE" and got["status"] == "COMPLETE", (sent, got)
    assert receiver.call("digest", remote) == block_digest(make_pool(P_BLOCKS, 32), local)
