"""The transfer-progress thread (kvtransfer/progress.py): it polls the shared sender/receiver
between engine steps, each result still reaches its owner's `poll` exactly once, a listener
hears of it on the progress thread, and the thread polls nothing while nothing is in flight."""

import threading
import time

import pytest

from kvtransfer import FakeFabric
from kvtransfer.poll_split import split_receiver, split_sender
from kvtransfer.progress import TransferProgress
from tests.kvtransfer.kv_fake_util import S, make

pytestmark = pytest.mark.timeout(30)


def _wait(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def _fake_pair():
    """P and D on a fake fabric: (P, D, P's push sender view, P's push receiver view, D's push
    receiver view, P's pull sender view)."""
    fabric = FakeFabric()
    p, _ = make(fabric, "P", 8, seed=1)
    d, _ = make(fabric, "D", 8, seed=2)
    p.add_peer(d.metadata())
    push_send, pull_send = split_sender(p.sender, "pull:")
    p_recv, _ = split_receiver(p.receiver, "pull:")
    push_recv, _ = split_receiver(d.receiver, "pull:")
    return p, d, push_send, p_recv, push_recv, pull_send


def test_results_collected_between_steps_reach_listener_and_owner_once():
    p, d, push_send, _, push_recv, pull_send = _fake_pair()
    heard = []
    push_send.listen(
        lambda r: heard.append((r.request_id, r.status, threading.current_thread().name))
    )
    progress = TransferProgress([push_send, push_recv])
    progress.start()
    try:
        push_recv.expect("push:a:0", [0, 1])
        push_send.send("push:a:0", "D", [(0, 0), (1, 1)], final=True)
        _wait(lambda: heard)  # nobody called poll: the progress thread collected it
        assert heard == [("push:a:0", S.COMPLETE, "kv-transfer-progress")]
        _wait(lambda: d.receiver.num_active == 0)
    finally:
        progress.stop()
    assert [(r.request_id, r.status) for r in push_send.poll()] == [("push:a:0", S.COMPLETE)]
    assert push_send.poll() == [] and pull_send.poll() == []
    assert [(r.request_id, r.status) for r in push_recv.poll()] == [("push:a:0", S.COMPLETE)]
    assert push_recv.poll() == []
    assert len(heard) == 1


class _Source:
    """A receiver that counts its polls; `active` says whether a transfer is in flight."""

    def __init__(self):
        self.polls = 0
        self.active = 0

    def poll(self):
        self.polls += 1
        return []

    def expect(self, request_id, block_ids, *, deadline=None, peer=None, idle_s=None):
        self.active = 1

    @property
    def num_active(self):
        return self.active


def test_idle_thread_polls_nothing_and_wakes_when_a_transfer_starts():
    source = _Source()
    view, _ = split_receiver(source, "pull:")  # type: ignore[arg-type]
    progress = TransferProgress([view], period_s=0.001)
    progress.start()
    try:
        time.sleep(0.05)
        assert source.polls == 0
        view.expect("push:a:0", [0])  # wakes the thread at once (not after its idle check)
        _wait(lambda: source.polls >= 3, timeout=0.4)
        source.active = 0
        time.sleep(0.01)
        polls = source.polls
        time.sleep(0.05)
        assert source.polls == polls
    finally:
        progress.stop()
    assert not progress._thread.is_alive()


def test_a_round_that_hears_a_result_wakes_the_engine_loop_and_quiet_rounds_do_not():
    """`on_results` is how a worker's engine loop learns of a transfer result at once,
    instead of polling every millisecond while the KV of a long prompt is on its way."""
    p, d, push_send, _, push_recv, _ = _fake_pair()
    wakes = []
    progress = TransferProgress([push_send, push_recv], on_results=lambda: wakes.append(1))
    progress.start()
    try:
        push_recv.expect("push:a:0", [0, 1], idle_s=5.0)
        push_send.send("push:a:0", "D", [], final=False, idle_s=5.0)  # open: in flight
        time.sleep(0.05)
        assert wakes == []  # rounds ran (keepalive timing aside), nothing finished
        push_send.send("push:a:0", "D", [(0, 0), (1, 1)], final=True)
        _wait(lambda: len(wakes) >= 1 and d.receiver.num_active == 0)
    finally:
        progress.stop()
    assert [r.status for r in push_recv.poll()] == [S.COMPLETE]
    assert [r.status for r in push_send.poll()] == [S.COMPLETE]


class _Counting:
    """A view whose `collect` calls are counted; everything else is the wrapped view's (a
    receiver's view has no `num_outstanding_writes`, and neither has this wrapper then)."""

    def __init__(self, view):
        self._view = view
        self.collects = 0

    def collect(self):
        self.collects += 1
        return self._view.collect()

    def __getattr__(self, name):
        return getattr(self._view, name)


def test_an_open_request_with_nothing_outstanding_is_polled_at_keepalive_pace():
    """A prefill worker computing a long prompt: its request to D is open (keepalives every
    ~1 s), no write outstanding. The thread used to poll every millisecond for the whole
    prompt; now it backs off (an upper bound on rounds: a slow machine only lowers it)."""
    p, d, push_send, p_recv, push_recv, _ = _fake_pair()
    views = [_Counting(push_send), _Counting(p_recv)]  # P's thread: P's two views
    progress = TransferProgress(views, period_s=0.001)
    progress.start()
    try:
        push_recv.expect("push:a:0", [0, 1], idle_s=30.0)
        push_send.send("push:a:0", "D", [], final=False, idle_s=30.0)  # open: in flight
        time.sleep(0.4)
        rounds = views[0].collects
        # doubling from 1 ms: 1+2+...+256 ms covers 0.4 s in 9 rounds (old code: ~400)
        assert 1 <= rounds <= 15, rounds
        assert views[1].collects == rounds  # every round collects every view
        push_send.send("push:a:0", "D", [(0, 0), (1, 1)], final=True)  # a write: busy
        _wait(lambda: push_recv.poll() != [] and push_send.poll() != [])
    finally:
        progress.stop()


def test_a_listening_receiver_backs_off_to_its_listen_period():
    """A decode worker waiting for a long prompt's KV: polled at most every listen period
    (10 ms; it used to be every millisecond), since the sender's write completes only once
    the receiver has polled."""
    p, d, push_send, p_recv, push_recv, _ = _fake_pair()
    view = _Counting(push_recv)
    progress = TransferProgress([view], period_s=0.001, listen_period_s=0.01)
    progress.start()
    try:
        push_recv.expect("push:a:0", [0, 1], idle_s=30.0)
        time.sleep(0.4)
        rounds = view.collects
        assert 1 <= rounds <= 60, rounds  # 0.4 s at >= 10 ms after the ramp (old code: ~400)
    finally:
        progress.stop()
    assert d.receiver.cancel("push:a:0")


def test_a_send_wakes_a_thread_asleep_at_once():
    """The thread sleeps (here: an hour, whenever it is not busy) until a send or an expect
    wakes it: the posted transfer completes without waiting out the sleep."""
    p, d, push_send, p_recv, push_recv, _ = _fake_pair()
    heard = []
    push_send.listen(heard.append)
    progress = TransferProgress([push_send, push_recv], period_s=0.001)
    paced = progress.next_sleep

    def hour_long(backoff):
        sleep, after = paced(backoff)
        return (sleep, after) if sleep <= 0.001 else (3600.0, 3600.0)

    progress.next_sleep = hour_long  # type: ignore[method-assign]
    progress.start()
    try:
        push_recv.expect("push:a:0", [0, 1], deadline=time.monotonic() + 60)
        _wait(lambda: progress.rounds >= 2)  # then asleep for an hour: nothing is busy
        time.sleep(0.05)
        rounds = progress.rounds
        push_send.send("push:a:0", "D", [(0, 0), (1, 1)], final=True)
        _wait(lambda: heard, timeout=10)
        assert [r.status for r in heard] == [S.COMPLETE]
        assert progress.rounds - rounds <= 5  # woken, busy for a round or two, asleep again
    finally:
        progress.stop()
    assert [r.status for r in push_recv.poll()] == [S.COMPLETE]


def test_keepalives_stay_on_time_when_the_thread_backs_off():
    """P's thread backs off while only its open request is in flight, but never past the
    request's next keepalive (`poll_due_s`): D's 1 s window never expires while P computes."""
    p, d, push_send, p_recv, push_recv, _ = _fake_pair()
    landed = []
    push_recv.listen(landed.append)
    p_thread = TransferProgress([push_send, p_recv], idle_period_s=5.0)  # far past the window
    d_thread = TransferProgress([push_recv])
    p_thread.start()
    d_thread.start()
    try:
        push_recv.expect("push:a:0", [0, 1], idle_s=1.0)
        push_send.send("push:a:0", "D", [], final=False, idle_s=1.0)  # keepalive every 0.25 s
        time.sleep(2.5)
        assert d.receiver.status("push:a:0") is S.PENDING  # kept open by the keepalives
        assert p_thread.rounds <= 40, p_thread.rounds  # ~4 a second (old code: ~2500)
        push_send.send("push:a:0", "D", [(0, 0), (1, 1)], final=True)
        _wait(lambda: landed)
    finally:
        p_thread.stop()
        d_thread.stop()
    assert [r.status for r in landed] == [S.COMPLETE]
    assert [r.status for r in push_recv.poll()] == [S.COMPLETE]
