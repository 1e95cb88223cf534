"""The prefill side keeps its source blocks pinned while a write may still read them, and
`when_ended` (what P's Worker.Abort waits for) fires only then. Fake transport, fake engine."""
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from engine.request import RequestStatus
from kvtransfer import FakeFabric, FakeTransferBackend, KVCompat, KVTransferConfig, TransferStatus
from prefill_node.kv_streamer import KVStreamer, Outgoing

pytestmark = pytest.mark.timeout(30)
BLOCK = 4


class _Blocks:
    block_size = BLOCK

    def __init__(self):
        self.refs = Counter()

    def blocks_for(self, n):
        return -(-n // BLOCK)

    def pin(self, ids):
        self.refs.update(ids)

    def release(self, ids):
        self.refs.subtract(ids)

    @property
    def pinned(self):
        return sorted(b for b, n in self.refs.items() if n)


class _Engine:
    def __init__(self):
        self.block_manager = _Blocks()
        self.aborted = []

    def abort_request(self, rid):
        self.aborted.append(rid)
        return True


def _backend(fabric, name):
    backend = FakeTransferBackend(fabric, KVTransferConfig(agent_name=name))
    pool = torch.zeros((16, 1, 2, BLOCK, 1, 4))
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
    req = SimpleNamespace(request_id="r", block_tables=[[5, 6, 7]], num_prompt_tokens=3 * BLOCK,
                          num_computed_tokens=2 * BLOCK, num_output_tokens=0,
                          status=RequestStatus.RUNNING, output_token_ids=[], logprobs=[])
    ended = []
    out = Outgoing(request=req, transfer_id="r:0", peer="D", dest_blocks=[1, 2, 3], group_skips=[0],
                   deadline=time.monotonic() + 30, on_done=lambda result, first: ended.append(result))
    streamer.add(out)
    streamer.after_step(engine)  # chunk 1 (two full blocks) is written: in flight
    assert engine.block_manager.pinned == [5, 6]
    if how == "cancel":
        streamer.cancel(engine, "r:0")
    else:  # the engine dropped the request (Worker.Abort, or the Prefill call was cancelled)
        req.status = RequestStatus.FINISHED_ABORTED
    waiters = []
    streamer.when_ended("r", lambda: waiters.append(True))
    for _ in range(3):
        streamer.after_step(engine)
    assert engine.block_manager.pinned == [5, 6]  # the write may still read them
    assert ended == [] and waiters == [] and streamer.active
    fabric.hold_releases("P", False)
    streamer.after_step(engine)
    assert engine.block_manager.pinned == [] and not streamer.active
    assert [r.status for r in ended] == [TransferStatus.CANCELLED] and waiters == [True]


def test_when_ended_fires_at_once_without_transfers():
    fired = []
    KVStreamer(sender=None).when_ended("r", lambda: fired.append(True))
    assert fired == [True]
