"""Workers on one host share its cores (`--share-host-cores`, off by default): a worker's step
uses its own thread share plus the shares of the workers on the host that are idle at the time.
Also the process's thread setup every worker goes through (`worker_threads`,
`release_openmp_threads`).

Why: `pdserve up --prefill 1 --decode 1` on a 2-core host gives each worker one thread (the
cores split between the workers). At low load only one role is working at a time, and a
fixed split leaves the other core idle: a prompt prefills at one core's speed where a single
engine uses both. With sharing, whichever role is busy alone runs on both cores; when both
are busy each runs on its own share, so neither steals the other's core under load (which
keeps the decode worker's tail ITL).

How: every sharing worker owns one small file in a per-user directory in shared memory
(`/dev/shm`), mapped into its memory: its share (threads), whether its engine has work, and
its process start time. Before each step a worker marks itself busy and sums the shares of
the other busy workers; the rest of the host's cores (its CPU affinity) are its threads for
the step, never fewer than its own share. When its engine runs out of work it marks itself
idle. A worker that finds its own share borrowed (a peer began a step while it was idle) waits
until the peer gives it back, which the peer does at its next step (at most one step, bounded
by LENT_WAIT_S; a peer that does not step in that time is not waited for again until it does):
so the host's workers never run more threads than it has cores, and a prompt arriving at an
idle prefill worker costs the busy decode worker one step on its own share, not a step whose
threads fight the prefill's for the cores. The directory is re-read about once a second; files of
processes that are gone are removed (the start time tells a reused pid from the writer). Workers in
different containers see different /dev/shm, so each keeps its own share there — the fixed split, as
before.

Thread counts change between steps only (`torch.set_num_threads` on the engine thread, a
no-op when unchanged). It pays with bounded OpenMP spinning (`GOMP_SPINCOUNT`, which `pdserve`'s
worker entry sets unless the environment names a policy) and with one OpenMP team per process
(`release_openmp_threads`): docs/workers.md, "Threads".
"""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


# share (threads), busy (0/1), threads of its current step (0 while idle), steps begun (wraps),
# process start time (clock ticks)
_RECORD = struct.Struct("<iiiiq")
_BUSY, _THREADS, _STEPS = slice(4, 8), slice(8, 12), slice(12, 16)
REFRESH_S = 1.0  # re-read the directory of sharing workers this often
LENT_WAIT_S = 0.1  # the longest a step waits for a peer to give back cores it borrowed
POLL_S = 0.0005


def default_dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"pdserve-host-cores-{os.getuid()}"


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or -1
    when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(slots=True)
class _Peer:
    pid: int
    view: mmap.mmap


class HostCoreShare:
    """This worker's entry in the host's core sharing. One per worker process, used from its
    engine-loop thread only (`begin_step`, `end_busy`); `close` when the worker stops."""

    def __init__(
        self,
        share: int,
        *,
        cores: int | None = None,
        directory: Path | None = None,
        set_threads=None,
    ) -> None:
        """`share`: this worker's own threads (kept when every other worker is busy);
        `cores`: the most threads a step may use (default: this process's CPU affinity);
        `set_threads(n)`: applies a thread count (default: torch.set_num_threads)."""
        self.share = max(1, share)
        self.cores = max(self.share, cores or host_cores())
        self.dir = directory or default_dir()
        self._set_threads = set_threads or _torch_set_threads
        self.threads = 0  # the count last applied (0: none yet)
        self._peers: dict[int, _Peer] = {}
        self._refreshed = float("-inf")
        self._busy = False
        self._steps = 0
        self._stuck: dict[
            int, int
        ] = {}  # peer pid -> its step count when this worker gave up waiting
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._path = self.dir / str(os.getpid())
        with open(self._path, "w+b") as f:
            f.write(_RECORD.pack(self.share, 0, 0, 0, _start_time(os.getpid())))
            f.flush()
            self._own = mmap.mmap(f.fileno(), _RECORD.size)

    def begin_step(self) -> int:
        """Marks this worker busy and applies its thread count for the coming step: the
        cores the other busy workers use leave, at least its own share (waiting, bounded,
        for a peer to give back cores it borrowed). Returns it."""
        if not self._busy:
            self._busy = True
            self._own[_BUSY] = _int32(1)
        self._steps = (self._steps + 1) & 0x7FFFFFFF
        self._own[_STEPS] = _int32(self._steps)
        free = self.cores - self._used_elsewhere()
        if free < self.share:
            free = self._wait_for_lent_cores(free)
        threads = min(self.cores, max(self.share, free))
        self._own[_THREADS] = _int32(threads)
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
        return threads

    def end_busy(self) -> None:
        """This worker's engine has no work: other workers may use its share."""
        if self._busy:
            self._busy = False
            self._own[_BUSY] = _int32(0)
            self._own[_THREADS] = _int32(0)

    @property
    def stalled_peers(self) -> frozenset[int]:
        """The peers (pids) this worker gave up waiting for and counts at their share only,
        until they step again."""
        return frozenset(self._stuck)

    def close(self) -> None:
        self.end_busy()
        for peer in self._peers.values():
            peer.view.close()
        self._peers.clear()
        self._own.close()
        self._path.unlink(missing_ok=True)

    def _used_elsewhere(self) -> int:
        """Cores the other busy workers hold: each its share, or the threads of its current
        step when it borrowed more (unless it stopped stepping while this worker waited)."""
        now = time.monotonic()
        if now - self._refreshed >= REFRESH_S:
            self._refresh()
            self._refreshed = now
        total = 0
        for pid, peer in self._peers.items():
            share, busy, threads, steps, _ = _RECORD.unpack(peer.view[: _RECORD.size])
            if pid in self._stuck and self._stuck[pid] != steps:
                del self._stuck[pid]  # it stepped since: counted as it is again
            if busy:
                total += share if pid in self._stuck else max(share, threads)
        return total

    def _wait_for_lent_cores(self, free: int) -> int:
        deadline = time.monotonic() + LENT_WAIT_S
        while free < self.share and time.monotonic() < deadline:
            time.sleep(POLL_S)
            free = self.cores - self._used_elsewhere()
        if free < self.share:  # peers that did not begin a step meanwhile: not waited for again
            for pid, peer in self._peers.items():
                self._stuck[pid] = _RECORD.unpack(peer.view[: _RECORD.size])[3]
            free = self.cores - self._used_elsewhere()  # they count with their shares now
        return free

    def _refresh(self) -> None:
        """The sharing workers now: new files mapped, files of gone processes removed."""
        me = os.getpid()
        seen: set[int] = set()
        for path in self.dir.iterdir():
            try:
                pid = int(path.name)
            except ValueError:
                continue
            if pid == me:
                continue
            peer = self._peers.get(pid) or self._map(path, pid)
            if peer is None:
                continue
            if _RECORD.unpack(peer.view[: _RECORD.size])[4] != _start_time(pid):
                peer.view.close()  # the writer is gone (or its pid now names another process)
                self._peers.pop(pid, None)
                path.unlink(missing_ok=True)
                continue
            self._peers[pid] = peer
            seen.add(pid)
        for pid in set(self._peers) - seen:
            self._peers.pop(pid).view.close()
        self._stuck = {pid: steps for pid, steps in self._stuck.items() if pid in self._peers}

    @staticmethod
    def _map(path: Path, pid: int) -> _Peer | None:
        try:
            with open(path, "rb") as f:
                return _Peer(pid, mmap.mmap(f.fileno(), _RECORD.size, access=mmap.ACCESS_READ))
        except (OSError, ValueError):  # removed meanwhile, or not yet written
            return None


def _int32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def worker_threads(num_threads: int, share_host_cores: bool) -> HostCoreShare | None:
    """Sets this process's torch threads to its share of the host (`num_threads`; 0: half the
    cores, at least 1) and returns its entry in the host's core sharing when asked for (the
    engine loop sizes each step through it)."""
    share = num_threads or max(1, host_cores() // 2)
    _torch_set_threads(share)
    return HostCoreShare(share) if share_host_cores else None


def release_openmp_threads() -> bool:
    """Ends the OpenMP threads the calling thread has started (libgomp's
    `omp_pause_resource_all(omp_pause_hard)`); they are started again if it runs a parallel
    region later. Returns whether the runtime did it.

    Why: the worker loads its model on the main thread and then steps it on the engine thread;
    each thread that runs parallel regions keeps a team of its own. With the main thread's idle
    team alive, libgomp manages more threads than the host has cores, and then it waits for a
    parallel region's threads almost without spinning: the engine thread's second thread gave
    no speed-up at all (measured: an elementwise op 197 us on 2 threads in the engine thread
    with the main thread's team alive, 77 us after releasing it, 171 us on 1 thread)."""
    import ctypes

    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):  # no libgomp in the process (another OpenMP runtime)
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(2) == 0  # omp_pause_hard


async def off_the_loop(fn: Callable[[], T]) -> T:
    """`fn()` on asyncio's thread pool (off the event loop), that thread's OpenMP threads
    ended afterwards (`release_openmp_threads`). Torch work there — loading a LoRA adapter,
    building a structured request — starts an OpenMP team of that thread's own, and while it
    lives the engine thread's parallel regions wait for their threads without spinning
    (2-core AMD EPYC: an elementwise op on the engine thread's 2 threads took 153-256 us,
    484-571 us once a pool thread had run one torch op, 141-165 us after its team ended)."""

    def run() -> T:
        try:
            return fn()
        finally:
            release_openmp_threads()

    return await asyncio.to_thread(run)
