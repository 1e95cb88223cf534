"""Transfers that follow their progress (`idle_s`): a long prompt computed on a slow prefill
worker never misses a fixed deadline; silence, or a stalled write, still fails the transfer.
Through the fake transport, whose request bookkeeping is the real code NIXL runs too."""

import time

import pytest
import torch
from kv_fake_util import S, step

from kvtransfer import RequestStateError
from kvtransfer.base import heartbeat_interval

pytestmark = pytest.mark.timeout(30)
WINDOW = 0.2


def _run_for(seconds, *backends):
    """Poll every backend (the progress thread and engine steps) for `seconds`."""
    results = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        results |= step(*backends)
        time.sleep(0.005)
    return results


def test_a_transfer_that_outlives_many_windows_completes_while_the_sender_keeps_it_alive(pd):
    """P computes for five windows between its batches: its keepalives keep D waiting, and
    the KV lands byte-identical."""
    p, ppool, d, dpool = pd
    remote, local = [3, 4, 5, 6], [10, 11, 12, 13]
    d.receiver.expect("r", remote, idle_s=WINDOW)
    p.sender.send("r", "D", [], final=False, idle_s=WINDOW)  # destination known: open
    assert _run_for(5 * WINDOW, p, d) == {}
    p.sender.send("r", "D", list(zip(local[:2], remote[:2])), final=False)
    assert _run_for(5 * WINDOW, p, d) == {}
    p.sender.send("r", "D", list(zip(local[2:], remote[2:])), final=True)
    results = _run_for(0.05, p, d)
    assert results[("recv", "r")].status is S.COMPLETE
    assert results[("send", "r")].status is S.COMPLETE
    assert torch.equal(dpool[remote], ppool[local])
    assert p.sender.num_outstanding_writes == 0 and d.receiver.num_active == 0


def test_a_silent_sender_fails_the_receiver_after_one_window(pd):
    """A sender that opened the request and then went silent (its process died, or never
    polls): D gives up one window after the last word, naming what landed."""
    p, _, d, _ = pd
    d.receiver.expect("r", [3, 4], idle_s=WINDOW)
    p.sender.send("r", "D", [(10, 3)], final=False, idle_s=WINDOW)
    assert step(p, d) == {}  # the batch lands (the fake moves it on P's poll)
    heard = time.monotonic()
    results = _run_for(3 * WINDOW, d)  # only D polls: P sends no keepalive
    failed = results[("recv", "r")]
    assert failed.status is S.TIMEOUT and failed.num_blocks == 1
    assert f"1/2 blocks landed, then nothing from the sender for {WINDOW:g}s" in failed.error
    assert failed.elapsed_s >= WINDOW and time.monotonic() - heard >= WINDOW
    p.sender.cancel("r")
    assert _run_for(0.02, p)[("send", "r")].status is S.CANCELLED


def test_an_absolute_deadline_beside_the_window_still_caps_the_wait(pd):
    p, _, d, _ = pd
    d.receiver.expect("r", [3], idle_s=WINDOW, deadline=time.monotonic() + 2 * WINDOW)
    p.sender.send("r", "D", [], final=False, idle_s=WINDOW)
    failed = _run_for(4 * WINDOW, p, d)[("recv", "r")]
    assert failed.status is S.TIMEOUT and "by the deadline" in failed.error
    assert 2 * WINDOW <= failed.elapsed_s < 3 * WINDOW
    p.sender.cancel("r")
    _run_for(0.02, p)


def test_the_sender_times_out_only_a_write_that_stalls(fabric, pd):
    """Nothing outstanding: the sender waits for its own engine however long; a write that
    makes no progress for a window fails the request."""
    p, _, d, _ = pd
    d.receiver.expect("r", [3, 4], idle_s=10.0)
    p.sender.send("r", "D", [], final=False, idle_s=WINDOW)
    assert _run_for(3 * WINDOW, p, d) == {}
    fabric.stall("D")
    p.sender.send("r", "D", [(10, 3)], final=False)
    failed = _run_for(3 * WINDOW, p)[("send", "r")]
    assert failed.status is S.TIMEOUT and f"no write completed for {WINDOW:g}s" in failed.error
    fabric.stall("D", False)
    d.receiver.cancel("r")
    _run_for(0.02, d)


def test_keepalives_come_often_enough_and_are_not_counted_as_dropped(pd):
    p, _, d, _ = pd
    assert heartbeat_interval(30.0) == 1.0 and heartbeat_interval(0.2) == pytest.approx(0.05)
    d.receiver.expect("r", [3], idle_s=WINDOW)
    p.sender.send("r", "D", [], final=False, idle_s=WINDOW)
    _run_for(2 * WINDOW, p, d)
    assert d.receiver.metrics.dropped_notifications == 0
    p.sender.send("r", "D", [(10, 3)], final=True)
    assert _run_for(0.05, p, d)[("recv", "r")].status is S.COMPLETE


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_a_window_must_be_positive(pd, bad):
    p, _, d, _ = pd
    with pytest.raises(RequestStateError, match="idle_s must be > 0"):
        d.receiver.expect("r", [3], idle_s=bad)
    with pytest.raises(RequestStateError, match="idle_s must be > 0"):
        p.sender.send("r", "D", [], final=False, idle_s=bad)
    assert d.receiver.num_active == 0 and p.sender.num_active == 0
