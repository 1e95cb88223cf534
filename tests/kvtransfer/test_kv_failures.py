"""Failure handling of the request state machines through the in-process fake transport:
deadlines, dead and hung peers, cancellation, contradicting or malformed notifications."""

import time

import pytest
import torch
from kv_fake_util import S, make, step

from kvtransfer import DuplicateRequestError, UnknownPeerError, wait_for

pytestmark = pytest.mark.timeout(30)


def test_all_blocks_without_final_notification_times_out(pd):
    p, _, d, _ = pd
    d.receiver.expect("r", [4, 5], deadline=time.monotonic() + 0.2)
    p.sender.send("r", "D", [(0, 4), (1, 5)], final=False)
    assert step(p, d) == {}
    assert d.receiver.progress("r") == (2, 2)
    results = wait_for(d.receiver, ["r"], 2)
    assert results["r"].status is S.TIMEOUT and results["r"].num_blocks == 2
    assert "final" not in results["r"].error


def test_sender_that_stops_midway_times_out_on_the_receiver(pd):
    p, _, d, _ = pd
    t0 = time.monotonic()
    d.receiver.expect("r", [1, 2, 3, 4], deadline=t0 + 0.3)
    p.sender.send("r", "D", [(0, 1), (1, 2)], final=False)
    seen = []
    while d.receiver.status("r") is S.PENDING or not seen:
        seen += step(p, d).values()
        time.sleep(0.01)
    (res,) = [r for r in seen if r.request_id == "r"]
    assert res.status is S.TIMEOUT and res.num_blocks == 2
    assert time.monotonic() - t0 >= 0.3
    assert "2/4 blocks landed" in res.error


def test_dead_receiver_fails_sender_requests_and_other_peers_keep_working(fabric, pd):
    p, ppool, d, _ = pd
    d2, d2pool = make(fabric, "D2", 16, seed=3)
    p.add_peer(d2.metadata())
    d.receiver.expect("a", [1, 2, 3])
    d.receiver.expect("b", [4])
    p.sender.send("a", "D", [(0, 1)], final=False)
    step(p, d)
    p.sender.send("b", "D", [(1, 4)], final=False)  # in flight when D dies
    fabric.kill("D")
    p.sender.send("a", "D", [(2, 2), (3, 3)], final=True)
    results = step(p)
    assert (
        results[("send", "a")].status is S.ERROR and "disconnected" in results[("send", "a")].error
    )
    assert results[("send", "b")].status is S.ERROR
    assert p.sender.num_active == 0 and p.sender.num_outstanding_writes == 0
    assert p.sender.metrics.peers["D"].failures == {"error": 2}
    d2.receiver.expect("c", [7])
    p.sender.send("c", "D2", [(9, 7)], final=True)
    results = step(p, d2)
    assert results[("recv", "c")].status is S.COMPLETE and torch.equal(d2pool[7], ppool[9])
    p.sender.send("d", "D", [(0, 1)], final=True)  # the dead peer fails fast
    assert step(p)[("send", "d")].status is S.ERROR


def test_hung_write_is_released_at_the_sender_deadline(fabric, pd):
    p, _, d, _ = pd
    fabric.stall("D")
    t0 = time.monotonic()
    p.sender.send("r", "D", [(0, 1)], final=True, deadline=t0 + 0.2)
    assert p.sender.num_outstanding_writes == 1
    results = wait_for(p.sender, ["r"], 2)
    assert results["r"].status is S.TIMEOUT and results["r"].num_blocks == 0
    assert time.monotonic() - t0 >= 0.2
    assert p.sender.num_outstanding_writes == 0 and p.sender.num_active == 0
    assert p.transport.released_handles == 1


def test_default_deadline_comes_from_config(fabric):
    p, _ = make(fabric, "P", 4, seed=1, default_timeout_s=0.05)
    d, _ = make(fabric, "D", 4, seed=2, default_timeout_s=0.05)
    p.add_peer(d.metadata())
    d.receiver.expect("r", [0])
    p.sender.send("r", "D", [(0, 0)], final=False)
    assert wait_for(d.receiver, ["r"], 2)["r"].status is S.TIMEOUT
    assert wait_for(p.sender, ["r"], 2)["r"].status is S.TIMEOUT


def test_cancel_on_both_sides(pd):
    p, _, d, _ = pd
    d.receiver.expect("r", [1, 2])
    p.sender.send("r", "D", [(0, 1)], final=False)
    assert p.sender.cancel("r") and not p.sender.cancel("r")
    p.sender.send("r", "D", [(1, 2)], final=True)  # ignored: already finished
    assert d.receiver.cancel("r") and not d.receiver.cancel("nope")
    results = step(p, d)
    assert results[("send", "r")].status is S.CANCELLED
    assert results[("recv", "r")].status is S.CANCELLED
    assert p.sender.num_outstanding_writes == 0
    assert d.receiver.metrics.dropped_notifications == 0
    d.receiver.expect("r2", [1, 2])  # blocks are free again once reported
    with pytest.raises(DuplicateRequestError):
        p.sender.send("r", "D", [(1, 2)], final=True)


def test_late_notifications_after_cancel_are_dropped(pd):
    p, ppool, d, dpool = pd
    d.receiver.expect("r", [1])
    p.sender.send("r", "D", [(0, 1)], final=True)
    d.receiver.cancel("r")
    results = step(p, d)
    assert results[("recv", "r")].status is S.CANCELLED
    assert d.receiver.metrics.dropped_notifications == 1


def test_receiver_fails_requests_whose_notifications_contradict_it(fabric, pd):
    p, _, d, _ = pd
    p2, _ = make(fabric, "P2", 8, seed=4)
    p2.add_peer(d.metadata())
    d.receiver.expect("unexpected", [1, 2])
    p.sender.send("unexpected", "D", [(0, 3)], final=False)
    d.receiver.expect("short", [5, 6])
    p.sender.send("short", "D", [(0, 5)], final=True)
    d.receiver.expect("two-senders", [8, 9])
    p.sender.send("two-senders", "D", [(0, 8)], final=False)
    step(p)
    p2.sender.send("two-senders", "D", [(0, 9)], final=True)
    d.receiver.expect("bound", [10], peer="P2")
    p.sender.send("bound", "D", [(0, 10)], final=True)
    results = step(p, p2, d)
    errors = {
        rid: results[("recv", rid)].error for rid in ["unexpected", "short", "two-senders", "bound"]
    }
    assert all(results[("recv", rid)].status is S.ERROR for rid in errors)
    assert "not expected" in errors["unexpected"]
    assert "announced 1 blocks, 2 were expected" in errors["short"]
    assert "bound to 'P'" in errors["two-senders"]
    assert "bound to 'P2'" in errors["bound"]


def test_malformed_notifications_are_dropped(fabric, pd):
    p, _, d, _ = pd
    d.transport.inbox += [
        ("P", b"garbage"),
        ("P", b"pdkv1:{"),
        ("P", b'pdkv1:{"r":"zz","s":0,"b":[]}'),
    ]
    d.receiver.expect("r", [1])
    p.sender.send("r", "D", [(0, 1)], final=True)
    results = step(p, d)
    assert results[("recv", "r")].status is S.COMPLETE
    assert d.receiver.metrics.dropped_notifications == 3


def test_restarted_peer_replaces_old_metadata(fabric, pd):
    p, _, d, _ = pd
    d.receiver.expect("r", [1, 2])
    p.sender.send("r", "D", [(0, 1)], final=False)
    d.close()
    d_new, _ = make(fabric, "D", 48, seed=9)
    p.add_peer(d_new.metadata())
    results = step(p)
    assert results[("send", "r")].status is S.ERROR and "replaced" in results[("send", "r")].error
    d_new.receiver.expect("r2", [1])
    p.sender.send("r2", "D", [(0, 1)], final=True)
    assert step(p, d_new)[("recv", "r2")].status is S.COMPLETE


def test_remove_peer_fails_pending_sends(pd):
    p, _, d, _ = pd
    p.sender.send("r", "D", [(0, 1)], final=False)
    p.remove_peer("D")
    p.remove_peer("never-added")
    assert step(p)[("send", "r")].status is S.ERROR
    with pytest.raises(UnknownPeerError):
        p.sender.send("r2", "D", [(0, 1)], final=True)


def test_close_cancels_pending_and_releases(fabric, pd):
    p, _, d, _ = pd
    fabric.stall("D")
    p.sender.send("r", "D", [(0, 1)], final=False)
    p.close()
    assert p.sender.num_outstanding_writes == 0
    assert p.transport.released_handles == 1


@pytest.mark.parametrize("end", ["cancel", "deadline"])
def test_a_write_that_cannot_be_cancelled_is_reported_only_once_released(fabric, pd, end):
    """The source blocks may be reused once `poll` reports the request: a failed request
    whose write the transport cannot cancel yet (it may still read them and land in D's
    blocks) stays unreported, on no timer, until the handle is released."""
    p, _, d, _ = pd
    fabric.stall("D")  # the write stays in flight
    fabric.hold_releases("P")  # ... and cannot be cancelled
    d.receiver.expect("r", [1, 2])
    p.sender.send("r", "D", [(0, 1)], final=False, deadline=time.monotonic() + 0.05)
    status = S.CANCELLED if end == "cancel" else S.TIMEOUT
    if end == "cancel":
        assert p.sender.cancel("r")
    else:
        time.sleep(0.06)
    for _ in range(3):
        assert ("send", "r") not in step(p)
    assert p.sender.status("r") is status
    assert p.sender.num_active == 1 and p.sender.num_outstanding_writes == 1
    assert not p.sender.cancel("r")  # already ended
    fabric.hold_releases("P", False)
    results = step(p)
    assert results[("send", "r")].status is status
    assert p.sender.num_active == 0 and p.sender.num_outstanding_writes == 0
