"""Two owners of one sender and one receiver (kvtransfer/poll_split.py): each view's poll
returns exactly its own transfers' results, once, whichever view polled the source first."""

import torch

from kvtransfer import FakeFabric
from kvtransfer.poll_split import split_receiver, split_sender
from tests.kvtransfer.kv_fake_util import S, make


def test_each_owner_gets_only_its_own_results_once():
    fabric = FakeFabric()
    p, p_pool = make(fabric, "P", 8, seed=1)
    d, d_pool = make(fabric, "D", 8, seed=2)
    p.add_peer(d.metadata())
    push_send, pull_send = split_sender(p.sender, "pull:")
    push_recv, pull_recv = split_receiver(d.receiver, "pull:")
    push_recv.expect("push:a:0", [0, 1])
    pull_recv.expect("pull:b:0", [2])
    push_send.send("push:a:0", "D", [(0, 0), (1, 1)], final=True)
    pull_send.send("pull:b:0", "D", [(2, 2)], final=True)
    # The pull side polls first: the push side's result waits for the push side.
    sent_pull = pull_send.poll()
    assert [(r.request_id, r.status) for r in sent_pull] == [("pull:b:0", S.COMPLETE)]
    assert [(r.request_id, r.status) for r in push_send.poll()] == [("push:a:0", S.COMPLETE)]
    assert pull_send.poll() == [] and push_send.poll() == []
    assert [r.request_id for r in push_recv.poll()] == ["push:a:0"]
    assert [r.request_id for r in pull_recv.poll()] == ["pull:b:0"]
    assert push_recv.poll() == [] and pull_recv.poll() == []
    assert torch.equal(d_pool[:3], p_pool[:3])
    # Everything else is the shared object's.
    assert pull_recv.num_active == push_recv.num_active == d.receiver.num_active == 0
    assert pull_send.metrics is p.sender.metrics


def test_two_owners_polling_every_step_poll_the_shared_object_once():
    class Counting:
        polls = 0

        def poll(self):
            self.polls += 1
            return []

    source = Counting()
    first, second = split_receiver(source, "pull:")  # type: ignore[arg-type]
    for _ in range(5):  # an engine step: both owners poll
        first.poll()
        second.poll()
    assert source.polls == 5
    for _ in range(3):  # only one owner polls (the other has nothing in flight)
        first.poll()
    assert source.polls == 8
