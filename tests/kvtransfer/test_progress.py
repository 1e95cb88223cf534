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


def test_results_collected_between_steps_reach_listener_and_owner_once():
    fabric = FakeFabric()
    p, _ = make(fabric, "P", 8, seed=1)
    d, _ = make(fabric, "D", 8, seed=2)
    p.add_peer(d.metadata())
    push_send, pull_send = split_sender(p.sender, "pull:")
    push_recv, _ = split_receiver(d.receiver, "pull:")
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
    fabric = FakeFabric()
    p, _ = make(fabric, "P", 8, seed=1)
    d, _ = make(fabric, "D", 8, seed=2)
    p.add_peer(d.metadata())
    push_send, _ = split_sender(p.sender, "pull:")
    push_recv, _ = split_receiver(d.receiver, "pull:")
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
