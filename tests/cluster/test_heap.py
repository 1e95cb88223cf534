"""cluster/heap.py: a server freezes its start-up heap, so later full collections skip it."""

import gc
import weakref

from cluster.heap import freeze_startup_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # only the cyclic collector can free it


def test_freezing_takes_the_start_up_heap_out_of_later_collections():
    frozen_before = gc.get_freeze_count()
    old = _Cycle()  # alive through start-up, garbage later
    old_ref = weakref.ref(old)
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > frozen_before
        new = _Cycle()  # made while serving
        new_ref = weakref.ref(new)
        del old, new
        gc.collect()
        # A full collection walks only what was made since the freeze: the new cycle is
        # freed, the frozen one not even looked at.
        assert new_ref() is None
        assert old_ref() is not None
    finally:
        gc.unfreeze()
    gc.collect()
    assert old_ref() is None  # unfrozen, it is garbage like any other
