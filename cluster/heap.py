"""The garbage collector in a long-running server process (workers and router).

Everything a process holds from its start-up — imported modules, the model and its
tokenizer, the app — stays alive until it exits, yet every full collection of CPython's
cyclic garbage collector walks all of it again, with the GIL held: every thread of the
process stops for the whole walk. A worker holds ~220,000 such objects; a full collection
took 139-150 ms on an idle 2-core AMD EPYC host and 0.4-0.9 s on a busy one (a 128-token
prefill step takes ~150 ms there), and full collections come whenever enough newer objects
have survived — requests, streams, protobuf messages — i.e. now and then in the middle of
serving: a stall of every stream.

`freeze_startup_heap` collects once and then moves every surviving object into the
permanent generation (`gc.freeze`), which collections skip: later ones walk only what was
made since (0.01 ms right after). vLLM's engine and API server do the same after start-up.
Frozen objects are still freed by reference counting; only a reference cycle among them
would stay (the start-up heap is not expected to form new garbage cycles)."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap() -> float:
    """Collect, then freeze what survives (see the module docstring); the seconds it took.
    Call once, when start-up is done and before serving."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    seconds = time.perf_counter() - t0
    log.info(
        "start-up heap frozen: %d objects out of the collector's walks (%.0f ms)",
        gc.get_freeze_count(),
        seconds * 1000,
    )
    return seconds
