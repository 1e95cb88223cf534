"""The KV transfer self-test a worker runs once at start: how fast its transfer path moves
bytes, next to a memcpy of the same bytes, so that a slow or fallback path (UCX on TCP where
shared memory / CMA or RDMA was expected, a missing `UCX_NET_DEVICES`, a fake backend) is
visible in the log, on /metrics and in `pdserve status` instead of silently slow.

What it does (`run_selftest`):

1. A SECOND, temporary agent of the worker's backend kind (`make_peer`, same
   `KVTransferConfig` but its own agent name) registers a small scratch pool: a few MiB of
   blocks of the worker's geometry and dtype, on the worker pool's device (huge pages on CPU,
   as the engine's pool).
2. The worker's own agent writes its first blocks into that pool through its transport —
   the same `post_write` a real batch uses (NIXL: one prepared WRITE with a notification,
   UCX as configured) — a warm-up round, then timed rounds until `rounds` or the time budget;
   the best round is the rate. The bytes that landed are compared with the source once.
3. A one-thread memcpy of the same bytes on the same device (numpy on CPU; a device copy on
   CUDA) gives the reference rate; the ratio is transfer / memcpy.
4. NIXL only: which transports UCX took. One more write, from a probe agent made with
   `UCX_PROTO_INFO=y`, whose protocol tables (printed to stderr, captured meanwhile) name
   them: `cma/memory` on one host, `tcp/<iface>` over sockets, `rc_mlx5/...` with RDMA.

The worker's agent only reads its pool and never sees the temporary agent as a peer: the
temporary agent is loaded into its transport under its lock and unloaded again, so its
backend's peer table, sender, receiver and metrics are untouched (this also sidesteps NIXL's
refusal to add our own name: the test never loops back to the worker's agent). A worker whose
agent cannot write whole blocks on its own (tensor-parallel rank 0) is measured between two
temporary agents with the same settings instead (`path` says so). Everything the test makes
is released on every exit; a write still in flight is cancelled. Any failure, including
running past `budget_s` (each NIXL call used here returns promptly: the budget bounds the
polling), is a result with `ok=False` and `path="failed: ..."`, never an exception.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtransfer.base import KVTransferBackend, KVTransferConfig
from kvtransfer.scratch import as_bytes, block_bytes, memcpy_seconds, same_bytes, scratch_like
from kvtransfer.ucx_proto_info import env_set, stderr_captured, ucx_write_transports

if TYPE_CHECKING:
    from kvtransfer.backend import TransportBackend

log = logging.getLogger(__name__)

PeerFactory = Callable[[KVTransferConfig], "TransportBackend"]
"""Makes a temporary agent of the worker's backend kind from a config (its own agent name)."""

TARGET_BYTES = 4 << 20
"""Bytes moved per round (rounded up to whole blocks; at most the worker's pool)."""
ROUNDS = 20
"""Timed rounds after the warm-up one, at most: the rate is the best round. A transport's
first rounds are slower (caches, UCX's registration cache), and on a loaded host some
rounds lose the CPU; many small rounds find the path's rate where a few large ones miss it."""
MEASURE_S = 0.3
"""No timed round starts after this many seconds of rounds (nor past the budget)."""
BUDGET_S = 1.0
"""Wall-clock bound of the whole test; past it the result is 'failed: timed out ...'."""
LOW_RATIO = 0.3
"""Below this ratio of memcpy the worker warns: the path is probably not the intended one.
Measured on the 2-vCPU development VM, its 2 cores shared with busy processes
(docs/kvtransfer.md, "Self-test at start"): CMA 0.42-0.75, UCX over TCP on loopback
0.10-0.16."""
NOTIF = b"pdkv-selftest"
"""The notification each timed write carries (a real batch carries one too)."""


@dataclass(frozen=True, slots=True)
class SelftestResult:
    """One self-test. Rates in GB/s (1e9 bytes per second); 0 where not measured."""

    ok: bool
    gbps: float
    """The transfer path's rate: the best timed round."""
    memcpy_gbps: float
    """A one-thread memcpy of the same bytes on the same device."""
    ratio: float
    """gbps / memcpy_gbps (0 when either is not measured)."""
    path: str
    """What moved the bytes (backend, memory, UCX settings), or 'failed: <why>'."""
    num_bytes: int = 0
    """Bytes per round."""
    seconds: float = 0.0
    """Wall time of the whole test, set-up and clean-up included."""

    @property
    def low(self) -> bool:
        """Measured, and slower than `LOW_RATIO` of memcpy."""
        return self.ok and self.ratio < LOW_RATIO

    def line(self) -> str:
        """The one log line: `KV transfer self-test: X GB/s = 0.YYx memcpy (Z GB/s) over P`."""
        if not self.ok:
            return f"KV transfer self-test {self.path}"
        return (
            f"KV transfer self-test: {self.gbps:.2f} GB/s = {self.ratio:.2f}x memcpy "
            f"({self.memcpy_gbps:.2f} GB/s) over {self.path}"
        )


class SelftestError(Exception):
    """Why a self-test could not measure (reported as `path='failed: ...'`)."""


def failed(reason: str, seconds: float = 0.0) -> SelftestResult:
    return SelftestResult(False, 0.0, 0.0, 0.0, f"failed: {reason}", seconds=seconds)


def nixl_peer(config: KVTransferConfig) -> TransportBackend:
    """`PeerFactory` of the NIXL backend."""
    from kvtransfer.nixl_backend import NixlTransferBackend

    return NixlTransferBackend(config)


def describe_path(
    transport_name: str, mem_type: str, via: str = "", transports: list[str] | None = None
) -> str:
    """The path in words: the backend, the memory it moves, and for NIXL the UCX transports
    its writes took (`transports`, when UCX told: `ucx_write_transports`) and the UCX settings
    this process runs with, which UCX picks its transports from."""
    if transport_name == "nixl":
        devices = os.environ.get("UCX_NET_DEVICES") or "all (unset)"
        tls = os.environ.get("UCX_TLS") or "any (unset)"
        settings = f"UCX_NET_DEVICES={devices} UCX_TLS={tls}"
        what = (
            f"nixl/UCX {mem_type} writes over {', '.join(transports)} ({settings})"
            if transports
            else f"nixl/UCX {mem_type} {settings}"
        )
    elif transport_name == "fake":
        what = f"fake (in-process torch copy, {mem_type}; not a real transport)"
    else:
        what = f"{transport_name} {mem_type}"
    return f"{what}{via}"


def run_selftest(
    backend: KVTransferBackend,
    pool: Any,
    make_peer: PeerFactory,
    *,
    target_bytes: int = TARGET_BYTES,
    rounds: int = ROUNDS,
    budget_s: float = BUDGET_S,
) -> SelftestResult:
    """Measure `backend`'s path with a temporary agent from `make_peer`; see the module
    docstring. `pool` is the tensor registered with `backend` (read only: its first blocks
    are the bytes sent). Never raises for a failed measurement."""
    start = time.perf_counter()
    try:
        with _Session(backend, pool, make_peer, target_bytes, start + budget_s) as s:
            return s.measure(rounds, start)
    except Exception as e:  # noqa: BLE001 - every failure is a result, never a failed start
        reason = str(e) if isinstance(e, SelftestError) else f"{type(e).__name__}: {e}"
        return failed(reason, time.perf_counter() - start)


class _Session:
    """The temporary agents and buffers of one self-test, released by `__exit__`."""

    def __init__(
        self,
        backend: KVTransferBackend,
        pool: Any,
        make_peer: PeerFactory,
        target_bytes: int,
        deadline: float,
    ) -> None:
        from kvtransfer.backend import TransportBackend

        if not isinstance(backend, TransportBackend):
            raise SelftestError(f"{type(backend).__name__} has no transport to measure")
        self.deadline = deadline
        self.make_peer = make_peer
        self.config = backend.config
        self.temps: list[TransportBackend] = []
        self.handle: Any = None
        self.writer: TransportBackend = backend
        """The agent that posted `handle`."""
        self.connected = False
        meta = backend.metadata()  # PoolError before register_pool: reported as failed
        self.num_blocks = max(1, min(meta.num_blocks, math.ceil(target_bytes / block_bytes(pool))))
        self.compat = dataclasses.replace(meta.compat, num_kv_heads=int(pool.shape[1]))
        self.mem_type = meta.mem_type
        self.pool = pool
        self.name = f"{backend.agent_name}.selftest-{uuid.uuid4().hex[:8]}"
        self.src: TransportBackend = backend
        self.sent = pool[: self.num_blocks]
        """The bytes every round writes: the source agent's first blocks."""
        self.via = ""

    def __enter__(self) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self._release_handle()
        if self.handle is not None:  # a write may still land: keep its target registered
            log.error("KV transfer self-test: leaving its temporary agents open")
            return
        try:
            if self.connected:
                with self.src.lock:
                    self.src.transport.disconnect(self.dst.agent_name)
                self.connected = False
            for temp in reversed(self.temps):
                temp.close()
        except Exception as e:  # noqa: BLE001 - the measurement stands; say what is left
            log.warning("KV transfer self-test: clean-up incomplete: %s", e)

    def _temp(self, name: str) -> tuple[TransportBackend, Any]:
        """A temporary agent with a zeroed scratch pool registered."""
        agent = self.make_peer(dataclasses.replace(self.config, agent_name=name))
        self.temps.append(agent)
        scratch = scratch_like(self.pool, self.num_blocks)
        agent.register_pool(scratch, self.compat)
        return agent, scratch

    def measure(self, rounds: int, start: float) -> SelftestResult:
        import numpy as np

        if self.src.transport.heads is not None:  # a tensor-parallel rank 0: see module doc
            self.src, self.sent = self._temp(f"{self.name}-src")
            self.sent.copy_(self.pool[: self.num_blocks])
            self.via = " (between temporary agents: tensor-parallel workers write in parts)"
        self.dst, self.received = self._temp(self.name)
        as_bytes(self.received).fill_(0xA5)  # unlike any pool's bytes: a write that moved
        # nothing (the fresh pool of a worker at start is all zeros) is not taken for one
        with self.src.lock:
            self.src.transport.connect(self.dst.metadata())
            self.connected = True
        ids = np.arange(self.num_blocks, dtype=np.int64)
        nbytes = self.num_blocks * block_bytes(self.pool)
        best, timed = math.inf, 0
        stop = time.perf_counter() + MEASURE_S
        for i in range(1 + rounds):
            now = time.perf_counter()
            if timed and (now > stop or now + 2 * best > self.deadline):
                break  # keep what was measured: another round might not fit
            seconds = self._write_once(ids)
            if i == 0 and not same_bytes(self.received, self.sent):
                raise SelftestError("the bytes that landed differ from the bytes sent")
            if i > 0:
                best, timed = min(best, seconds), timed + 1
        if not timed:
            raise SelftestError("timed out: no timed round fit in the budget")
        memcpy = memcpy_seconds(self.sent, timed)
        gbps, memcpy_gbps = nbytes / best / 1e9, nbytes / memcpy / 1e9
        transports = self._probe(ids) if self.src.transport.name == "nixl" else None
        return SelftestResult(
            True,
            gbps,
            memcpy_gbps,
            gbps / memcpy_gbps,
            describe_path(self.src.transport.name, self.mem_type, self.via, transports),
            nbytes,
            time.perf_counter() - start,
        )

    def _probe(self, ids: Any) -> list[str] | None:
        """Which UCX transports a write from this process to another agent takes: one more
        write into the scratch pool, from a probe agent made with `UCX_PROTO_INFO=y` (UCX reads
        it per agent; the worker's own agent stays quiet), whose protocol tables UCX prints to
        stderr — captured while the probe lives, parsed (`ucx_write_transports`), and what
        else reached stderr meanwhile written through. The probe runs in this process with
        its settings, so it takes the worker's path. None if UCX told nothing."""
        try:
            with stderr_captured() as captured:
                with env_set("UCX_PROTO_INFO", "y"):
                    probe, _ = self._temp(f"{self.name}-probe")
                with probe.lock:
                    probe.transport.connect(self.dst.metadata())
                self._write_once(ids, probe)
                probe.close()  # inside the capture: UCX may print while it tears down
                self.temps.remove(probe)
        except Exception as e:  # noqa: BLE001 - the measurement stands without it
            log.debug("KV transfer self-test: no UCX protocol info: %s", e)
            return None
        return ucx_write_transports(captured[0]) or None

    def _write_once(self, ids: Any, writer: TransportBackend | None = None) -> float:
        """Post one write of every scratch block from `writer` (the source agent) into the
        scratch pool and poll both sides until it is done (a NIXL write that carries a
        notification is done once the notification is out, which takes the receiver's
        progress). Seconds from post to done."""
        from kvtransfer.transport import WriteState

        self.writer = writer or self.src
        t0 = time.perf_counter()
        with self.writer.lock:
            self.handle = self.writer.transport.post_write(
                self.dst.agent_name, ids, ids, NOTIF, time.monotonic() + BUDGET_S
            )
        state = WriteState.PROC
        while state is WriteState.PROC:
            with self.writer.lock:
                state = self.writer.transport.check(self.handle)
            with self.dst.lock:
                self.dst.pump()
                self.dst.take_notifications()
            if state is WriteState.PROC and time.perf_counter() > self.deadline:
                raise SelftestError("timed out: a write did not complete within the budget")
        seconds = time.perf_counter() - t0
        if state is WriteState.ERR:
            raise SelftestError("the transport reported the write failed")
        self._release_handle()
        if self.handle is not None:
            raise SelftestError("the transport would not release a finished write")
        return seconds

    def _release_handle(self) -> None:
        """Release (cancel) the write handle; retried for a moment if still in flight."""
        if self.handle is None:
            return
        until = time.perf_counter() + 0.5
        while True:
            with self.writer.lock:
                if self.writer.transport.release(self.handle):
                    self.handle = None
                    return
            if time.perf_counter() > until:
                log.error("KV transfer self-test: a write handle could not be released")
                return
            time.sleep(0.001)
