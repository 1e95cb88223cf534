"""The prefill side keeps its source blocks pinned while a write may still read them, and
`when_ended` (what P's Worker.Abort waits for) fires only then. Fake transport, fake engine."""

import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from engine.core.request import RequestStatus
from kvtransfer import FakeFabric, FakeTransferBackend, KVCompat, KVTransferConfig, TransferStatus
from prefill_node.kv_streamer import KVStreamer, Outgoing

pytestmark = pytest.mark.timeout(30)
BLOCK = 4


class _Pool:
    def __init__(self):
        self.refs = Counter()

    def pin(self, ids):
        self.refs.update(ids)

    def release(self, ids):
        self.refs.subtract(ids)

    @property
    def pinned(self):
        return sorted(b for b, n in self.refs.items() if n)


class _Blocks:
    block_size = BLOCK

    def __init__(self):
        self.pool = _Pool()

    def blocks_for(self, n):
        return -(-n // BLOCK)


class _Engine:
    def __init__(self):
        self.block_manager = _Blocks()
        self.aborted = []

    def abort_request(self, rid):
        self.aborted.append(rid)
        return True


def _backend(fabric, name):
    backend = FakeTransferBackend(fabric, KVTransferConfig(agent_name=name))
    pool = torch.zeros((16, 1, 1, 2, BLOCK, 4))  # [blocks, heads, layers, K/V, tokens, dim]
    backend.register_pool(pool, KVCompat.for_pool(pool, "m"))
    return backend


@pytest.mark.parametrize("how", ["cancel", "engine_abort"])
def test_source_blocks_stay_pinned_until_an_uncancellable_write_is_released(how):
    fabric = FakeFabric()
    p, d = _backend(fabric, "P"), _backend(fabric, "D")
    p.add_peer(d.metadata())
    fabric.stall("D")
    fabric.hold_releases("P")
    engine, streamer = _Engine(), KVStreamer(p.sender)
    req = SimpleNamespace(
        request_id="r",
        block_tables=[[5, 6, 7]],
        num_prompt_tokens=3 * BLOCK,
        num_computed_tokens=2 * BLOCK,
        num_output_tokens=0,
        status=RequestStatus.RUNNING,
        output_token_ids=[],
        logprobs=[],
    )
    ended = []
    out = Outgoing(
        request=req,
        transfer_id="r:0",
        peer="D",
        dest_blocks=[1, 2, 3],
        group_skips=[0],
        deadline=time.monotonic() + 30,
        idle_s=30.0,
        on_done=lambda result, first: ended.append(result),
    )
    streamer.add(out)
    streamer.after_step(engine)  # chunk 1 (two full blocks) is written: in flight
    assert engine.block_manager.pool.pinned == [5, 6]
    if how == "cancel":
        streamer.cancel(engine, "r:0")
    else:  # the engine dropped the request (Worker.Abort, or the Prefill call was cancelled)
        req.status = RequestStatus.FINISHED_ABORTED
    waiters = []
    streamer.when_ended("r", lambda: waiters.append(True))
    for _ in range(3):
        streamer.after_step(engine)
    assert engine.block_manager.pool.pinned == [5, 6]  # the write may still read them
    assert ended == [] and waiters == [] and streamer.active
    fabric.hold_releases("P", False)
    streamer.after_step(engine)
    assert engine.block_manager.pool.pinned == [] and not streamer.active
    assert [r.status for r in ended] == [TransferStatus.CANCELLED] and waiters == [True]


def test_when_ended_fires_at_once_without_transfers():
    fired = []
    KVStreamer(sender=None).when_ended("r", lambda: fired.append(True))
    assert fired == [True]


def test_a_complete_transfer_answers_between_steps_once_and_releases_after_the_step():
    """The progress thread's collect answers the caller (first token included) before the
    engine's next step; that step releases the pinned blocks and does not answer again."""
    from kvtransfer.poll_split import split_sender

    fabric = FakeFabric()
    p, d = _backend(fabric, "P"), _backend(fabric, "D")
    p.add_peer(d.metadata())
    d.receiver.expect("r:0", [1, 2, 3])
    sender, _ = split_sender(p.sender, "pull:")
    engine, streamer = _Engine(), KVStreamer(sender)
    sender.listen(streamer.answer_early)
    req = SimpleNamespace(
        request_id="r",
        block_tables=[[5, 6, 7]],
        num_prompt_tokens=3 * BLOCK - 1,
        num_computed_tokens=3 * BLOCK - 1,
        num_output_tokens=1,
        status=RequestStatus.FINISHED_LENGTH,
        output_token_ids=[42],
        logprobs=[],
    )
    ended = []
    streamer.add(
        Outgoing(
            request=req,
            transfer_id="r:0",
            peer="D",
            dest_blocks=[1, 2, 3],
            group_skips=[0],
            deadline=time.monotonic() + 30,
            idle_s=30.0,
            on_done=lambda result, first: ended.append((result.status, first)),
        )
    )
    fabric.stall("D")  # still in flight when the step ends
    streamer.after_step(engine)  # the final batch goes out
    assert ended == [] and engine.block_manager.pool.pinned == [5, 6, 7]
    fabric.stall("D", False)
    deadline = time.monotonic() + 5
    while not ended and time.monotonic() < deadline:
        sender.collect()  # what the progress thread does between steps
        d.receiver.poll()
    assert [(s, f.token_id) for s, f in ended] == [(TransferStatus.COMPLETE, 42)]
    assert engine.block_manager.pool.pinned == [5, 6, 7]  # released by the engine thread only
    streamer.after_step(engine)
    assert engine.block_manager.pool.pinned == [] and not streamer.active
    assert len(ended) == 1 and engine.aborted == []


def _deferred(req, ended, deadline_s=30.0):
    return Outgoing(
        request=req,
        transfer_id="r:0",
        peer="D",
        dest_blocks=None,
        group_skips=None,
        deadline=time.monotonic() + deadline_s,
        idle_s=deadline_s,
        on_done=lambda result, first: ended.append((result.status, first)),
    )


def _prompt(computed_blocks, finished):
    return SimpleNamespace(
        request_id="r",
        block_tables=[[5, 6, 7]],
        num_prompt_tokens=3 * BLOCK,
        num_computed_tokens=computed_blocks * BLOCK,
        num_output_tokens=int(finished),
        status=RequestStatus.FINISHED_LENGTH if finished else RequestStatus.RUNNING,
        output_token_ids=[42] if finished else [],
        logprobs=[],
    )


@pytest.mark.parametrize("order", ["destination_first", "prefill_first"])
def test_a_deferred_destination_sends_nothing_until_it_comes_then_everything_minus_the_skip(order):
    """D parks while P computes: whichever ends first, the KV goes out once the destination
    is there, skipping D's cached blocks; a prompt that finished first stays pinned meanwhile."""
    fabric = FakeFabric()
    p, d = _backend(fabric, "P"), _backend(fabric, "D")
    p.add_peer(d.metadata())
    d.receiver.expect("r:0", [8, 9])
    engine, streamer = _Engine(), KVStreamer(p.sender)
    req, ended = _prompt(2, finished=False), []
    streamer.add(_deferred(req, ended))
    streamer.after_step(engine)  # two blocks computed, no destination: nothing goes out
    assert engine.block_manager.pool.pinned == [] and d.receiver.poll() == []
    if order == "destination_first":
        streamer.set_destination(engine, "r:0", [8, 9], [1])  # D has block 0 cached
        streamer.after_step(engine)  # block 1 (complete, not skipped) goes out now
        assert engine.block_manager.pool.pinned == [6]
    req.num_computed_tokens, req.num_output_tokens = 3 * BLOCK, 1
    req.status, req.output_token_ids = RequestStatus.FINISHED_LENGTH, [42]
    streamer.after_step(engine)  # the step that finished the prompt
    if order == "prefill_first":
        assert (
            engine.block_manager.pool.pinned == [5, 6, 7] and ended == []
        )  # held for the destination
        streamer.set_destination(engine, "r:0", [8, 9], [1])
    deadline = time.monotonic() + 5
    while not ended and time.monotonic() < deadline:
        streamer.after_step(engine)
        d.receiver.poll()
    assert [(s, f.token_id) for s, f in ended] == [(TransferStatus.COMPLETE, 42)]
    assert engine.block_manager.pool.pinned == [] and not streamer.active
    with pytest.raises(KeyError):  # no such transfer in flight any more
        streamer.set_destination(engine, "r:0", [8, 9], [1])


def test_a_deferred_destination_that_never_comes_times_out_and_releases():
    fabric = FakeFabric()
    p = _backend(fabric, "P")
    engine, streamer = _Engine(), KVStreamer(p.sender)
    ended = []
    streamer.add(_deferred(_prompt(3, finished=True), ended, deadline_s=0.05))
    streamer.after_step(engine)
    assert engine.block_manager.pool.pinned == [5, 6, 7] and ended == []
    time.sleep(0.06)
    streamer.after_step(engine)
    assert [s for s, _ in ended] == [
        TransferStatus.TIMEOUT
    ] and engine.block_manager.pool.pinned == []
    assert not streamer.active


def test_a_cancelled_deferred_prefill_releases_its_held_blocks_at_once():
    fabric = FakeFabric()
    p = _backend(fabric, "P")
    engine, streamer = _Engine(), KVStreamer(p.sender)
    ended = []
    streamer.add(_deferred(_prompt(3, finished=True), ended))
    streamer.after_step(engine)
    assert engine.block_manager.pool.pinned == [5, 6, 7]
    streamer.cancel(engine, "r:0")  # nothing was ever posted: finished here
    assert [s for s, _ in ended] == [
        TransferStatus.CANCELLED
    ] and engine.block_manager.pool.pinned == []


def test_a_second_destination_for_the_same_transfer_is_refused():
    fabric = FakeFabric()
    p, d = _backend(fabric, "P"), _backend(fabric, "D")
    p.add_peer(d.metadata())
    d.receiver.expect("r:0", [8, 9, 10])
    engine, streamer = _Engine(), KVStreamer(p.sender)
    streamer.add(_deferred(_prompt(0, finished=False), []))
    streamer.set_destination(engine, "r:0", [8, 9, 10], [0])
    with pytest.raises(ValueError, match="already has its destination"):
        streamer.set_destination(engine, "r:0", [8, 9, 10], [0])


def test_a_destination_for_a_queued_prompt_opens_the_transfer_and_keepalives_flow():
    """The prompt waits in this worker's queue (not admitted: no blocks) when D's destination
    comes — opened from the asyncio side (`open`), as the worker does on SetDestination: D
    hears keepalives however long the queue is, and nothing is written yet."""
    fabric = FakeFabric()
    p, d = _backend(fabric, "P"), _backend(fabric, "D")
    p.add_peer(d.metadata())
    d.receiver.expect("r:0", [8, 9, 10], idle_s=0.1)
    engine, streamer = _Engine(), KVStreamer(p.sender)
    req, ended = _prompt(0, finished=False), []
    req.block_tables = []  # queued
    out = _deferred(req, ended, deadline_s=0.1)
    streamer.add(out)
    out.dest_blocks, out.group_skips = [8, 9, 10], [0]
    streamer.open(out)
    end = time.monotonic() + 0.5  # five of D's windows
    while time.monotonic() < end:
        streamer.after_step(engine)  # the engine steps other prompts
        p.sender.poll()  # the progress thread: keepalives
        assert d.receiver.poll() == []
        time.sleep(0.005)
    assert d.receiver.progress("r:0") == (0, 3) and engine.block_manager.pool.pinned == []
    streamer.open(out)  # a second open (the engine side) changes nothing
    streamer.cancel(engine, "r:0")
    for _ in range(3):
        streamer.after_step(engine)
    assert ended == [(TransferStatus.CANCELLED, None)]
    assert not streamer.active and p.sender.num_active == 0
    d.receiver.cancel("r:0")
