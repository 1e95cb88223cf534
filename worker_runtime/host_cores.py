"""Workers on one host share its cores: a worker's step uses its own thread share plus the
shares of the workers on the host that are idle at the time.

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
idle. The directory is re-read about once a second; files of processes that are gone are
removed (the start time tells a reused pid from the writer). Workers in different containers
see different /dev/shm, so each keeps its own share there — the fixed split, as before.

Thread counts change between steps only (`torch.set_num_threads`, a no-op when unchanged).
It pays with OpenMP's passive waiting (`OMP_WAIT_POLICY=PASSIVE`, which `pdserve`'s worker
entry sets unless the environment names a policy): spinning threads of two processes that
briefly overlap on a core stall each other at every parallel region."""
from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_RECORD = struct.Struct("<iiq")  # share (threads), busy (0/1), process start time (clock ticks)
REFRESH_S = 1.0  # re-read the directory of sharing workers this often


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

    def __init__(self, share: int, *, cores: int | None = None, directory: Path | None = None,
                 set_threads=None) -> None:
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
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._path = self.dir / str(os.getpid())
        with open(self._path, "w+b") as f:
            f.write(_RECORD.pack(self.share, 0, _start_time(os.getpid())))
            f.flush()
            self._own = mmap.mmap(f.fileno(), _RECORD.size)

    def begin_step(self) -> int:
        """Marks this worker busy and applies its thread count for the coming step: the
        cores the other busy workers' shares leave, at least its own share. Returns it."""
        if not self._busy:
            self._busy = True
            self._own[4:8] = b"\x01\x00\x00\x00"
        threads = min(self.cores, max(self.share, self.cores - self._busy_elsewhere()))
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
        return threads

    def end_busy(self) -> None:
        """This worker's engine has no work: other workers may use its share."""
        if self._busy:
            self._busy = False
            self._own[4:8] = b"\x00\x00\x00\x00"

    def close(self) -> None:
        self.end_busy()
        for peer in self._peers.values():
            peer.view.close()
        self._peers.clear()
        self._own.close()
        self._path.unlink(missing_ok=True)

    def _busy_elsewhere(self) -> int:
        now = time.monotonic()
        if now - self._refreshed >= REFRESH_S:
            self._refresh()
            self._refreshed = now
        total = 0
        for peer in self._peers.values():
            share, busy, _ = _RECORD.unpack(peer.view[:_RECORD.size])
            total += share if busy else 0
        return total

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
            if _RECORD.unpack(peer.view[:_RECORD.size])[2] != _start_time(pid):
                peer.view.close()  # the writer is gone (or its pid now names another process)
                self._peers.pop(pid, None)
                path.unlink(missing_ok=True)
                continue
            self._peers[pid] = peer
            seen.add(pid)
        for pid in set(self._peers) - seen:
            self._peers.pop(pid).view.close()

    @staticmethod
    def _map(path: Path, pid: int) -> _Peer | None:
        try:
            with open(path, "rb") as f:
                return _Peer(pid, mmap.mmap(f.fileno(), _RECORD.size, access=mmap.ACCESS_READ))
        except (OSError, ValueError):  # removed meanwhile, or not yet written
            return None


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


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
