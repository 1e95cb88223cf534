"""Rank 0's handle on a tensor-parallel group: it starts ranks 1..N-1 as child processes
(`python -m engine.parallel.rank_worker`), joins them in one torch.distributed group on a
free loopback port, sends them what to do (load a model, size the pool, each step, release,
exit) and supervises them.

Life cycle: `ParallelGroup(size, ...)` (children start; the rendezvous waits at most
`timeout_s`) -> per engine: `load(config)` -> `allocate(num_blocks)` -> `send_step(step)` every
step -> `release()` -> ... -> `shutdown()` (or process exit). One group may serve several
engines in turn (tests reuse one across cases); one engine at a time, and one group per
process (torch.distributed's default group).

Failure: a child that exits while the group is up marks the group failed; the next message
raises RankFailedError, and `on_failure(reason)` is called at once from the monitor thread
(a worker sets it to exit the process non-zero so its supervisor restarts it: a worker with a
missing rank cannot serve). A rank that dies or hangs during a step makes rank 0's collective
raise within the timeout (communicator.py). Children exit when rank 0 dies (rank_worker.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.parallel.communicator import DistributedCommunicator
from engine.parallel.step import StepInputs

log = logging.getLogger(__name__)


class RankFailedError(RuntimeError):
    """A rank of the tensor-parallel group exited or cannot be reached."""


@dataclass(frozen=True)
class RankSpec:
    """What a child rank is started with (pickled on its stdin)."""

    rank: int
    size: int
    port: int
    timeout_s: float
    threads: int
    """torch threads of the rank (its share of the worker's)."""
    device: str
    """"cpu", or "cuda" (rank r uses cuda:r)."""
    parent_pid: int


@dataclass(frozen=True)
class LoadModel:
    """Load this engine config's model (the rank's shard)."""

    config: Any  # EngineConfig


@dataclass(frozen=True)
class AllocatePool:
    num_blocks: int


@dataclass(frozen=True)
class Release:
    """The engine closed: drop the model and the pool."""


@dataclass(frozen=True)
class Shutdown:
    """Exit."""


class RankTask(Protocol):
    """A message another package defines (kvtransfer/rank_agent.py: each rank's KV transfer
    agent): every other rank runs `run_on_rank(ctx)` with its `RankContext`; with `gather`
    their return values come back to rank 0 (`ParallelGroup.call`)."""

    gather: bool

    def run_on_rank(self, ctx: Any) -> Any: ...


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_threads(size: int, total: int | None = None) -> int:
    """Each rank's share of the process's torch threads (at least 1)."""
    return max(1, (total or torch.get_num_threads()) // size)


class ParallelGroup:
    def __init__(
        self,
        size: int,
        timeout_s: float = 60.0,
        device: str = "cpu",
        threads: int | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """Start ranks 1..size-1 and join them (rank 0 is this process). `threads`: torch
        threads per rank (default: this process's threads split evenly; rank 0 is set to
        the same)."""
        import torch.distributed as dist

        if size < 2:
            raise ValueError("a parallel group has at least 2 ranks")
        if dist.is_initialized():
            raise RuntimeError(
                "this process already runs a tensor-parallel group (one at a time: "
                "close the engine that owns it first, LLM.close())"
            )
        self.size, self.timeout_s = size, timeout_s
        self.threads = threads or rank_threads(size)
        self.on_failure = on_failure
        self.failed: str | None = None
        self._closing = False
        self._send_lock = threading.Lock()
        """Messages and their gathers go out whole, whichever thread sends them."""
        port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.children = []
        for rank in range(1, size):
            child = subprocess.Popen(
                [sys.executable, "-m", "engine.parallel.rank_worker"],
                stdin=subprocess.PIPE,
                env=env,
            )
            assert child.stdin is not None  # stdin=PIPE
            child.stdin.write(
                pickle.dumps(
                    RankSpec(rank, size, port, timeout_s, self.threads, device, os.getpid())
                )
            )
            child.stdin.close()
            self.children.append(child)
        atexit.register(self._kill)
        torch.set_num_threads(self.threads)
        try:
            self.comm = DistributedCommunicator(0, size, port, timeout_s, torch.device(device))
        except Exception:
            self._kill()
            raise
        self._monitor = threading.Thread(target=self._watch, name="tp-rank-monitor", daemon=True)
        self._monitor.start()

    # ---- messages to the ranks (rank 0's engine thread) ------------------------------------
    def send(self, message: Any) -> None:
        """Broadcast one message (the ranks handle it in order)."""
        with self._send_lock:
            self._send(message)

    def _send(self, message: Any) -> None:
        if self.failed:
            raise RankFailedError(self.failed)
        try:
            self.comm.broadcast_payload(message)
        except RuntimeError as exc:
            raise RankFailedError(f"tensor-parallel rank unreachable: {exc}") from exc

    def call(self, task: RankTask) -> list[Any] | None:
        """Run `task` on ranks 1..N-1; with `task.gather` their results, in rank order."""
        with self._send_lock:
            self._send(task)
            if not task.gather:
                return None
            try:
                gathered = self.comm.gather_payload(None)
                assert gathered is not None  # this is rank 0
                return gathered[1:]
            except RuntimeError as exc:
                raise RankFailedError(f"tensor-parallel rank unreachable: {exc}") from exc

    def load(self, config: Any) -> None:
        self.send(LoadModel(config))

    def allocate(self, num_blocks: int) -> None:
        self.send(AllocatePool(num_blocks))

    def send_step(self, step: StepInputs) -> None:
        self.send(step)

    def release(self) -> None:
        if not self.failed and not self._closing:
            self.send(Release())

    def shutdown(self) -> None:
        """Tell the ranks to exit and wait for them (killed after the timeout)."""
        if self._closing:
            return
        self._closing = True
        try:
            if not self.failed:
                self.comm.broadcast_payload(Shutdown())
            for child in self.children:
                child.wait(timeout=self.timeout_s)
        except Exception:  # noqa: BLE001 - whatever went wrong, no child outlives this
            log.warning("tensor-parallel ranks did not exit cleanly; killing them")
        finally:
            self._kill()
            self.comm.close()

    # ---- supervision -----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing:
            for rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code is not None and not self._closing:
                    self._fail(
                        f"tensor-parallel rank {rank} (pid {child.pid}) exited with code {code}"
                    )
                    return
            threading.Event().wait(0.2)

    def _fail(self, reason: str) -> None:
        self.failed = reason
        log.error("%s: this worker cannot run its model any more", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def _kill(self) -> None:
        self._closing = True
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children]
