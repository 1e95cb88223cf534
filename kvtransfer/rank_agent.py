"""The KV transfer agent of ranks 1..N-1 of a tensor-parallel worker, and the messages rank 0
sends them over the group's channel (engine/parallel/group.py `ParallelGroup.call`).

Rank 0 is the worker to the outside: its `NixlTransport` owns the peers, the request state
machines and every notification a peer counts. Each other rank has its own NIXL agent with
its own pool registered (its heads of every block) and does only what rank 0 tells it:

* `RegisterRankPool` (once, at start-up; gathered): register the pool, return its `RankPool`
  for rank 0's published metadata.
* `PostRankWrites` (per batch this rank has a slice of): post its slices into the peer's
  ranks (nixl_slices.py); then, once none of those writes can still move data (all done, or
  failed / past the deadline and cancelled), report `token:ok` to rank 0's agent.
* `CloseRankAgent`: deregister and stop.

A thread polls the agent: every millisecond while writes are in flight or notifications
arrived lately (the part notifications of writes into this rank's pool, which it drops —
UCX progresses only inside calls, and a writer's transfer completes only after the receiving
side progressed), every 5 ms otherwise.

Messages run on the rank through `run_on_rank(ctx)`, `ctx` giving `rank`, `kv_cache` and
`services` (a dict kept for the engine's lifetime; services with `close()` are closed when
the engine is released). This module does not import the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransfer.base import KVTransferConfig
from kvtransfer.heads import HeadRange
from kvtransfer.metadata import PeerMetadata, RankPool
from kvtransfer.nixl_slices import (
    PART_NOTIF,
    RANK_REPORT,
    SliceWriter,
    make_agent,
    pool_geometry,
    rank_agent_name,
)

log = logging.getLogger(__name__)

SERVICE = "kv_rank_agent"
BUSY_POLL_S = 0.001
IDLE_POLL_S = 0.005
BUSY_AFTER_NOTIF_S = 1.0
"""How long the agent keeps polling fast after a notification arrived."""


@dataclass(slots=True)
class _Token:
    handles: list[Any]
    deadline: float
    ok: bool = True


class RankAgent:
    def __init__(
        self,
        agent_name: str,
        rank: int,
        ranges: list[HeadRange],
        kv_cache: Any,
        config: KVTransferConfig,
        rank0_name: str,
        rank0_metadata: bytes,
    ) -> None:
        self.name = rank_agent_name(agent_name, rank)
        self.rank0 = rank0_name
        self.lock = threading.Lock()
        self._agent, _ = make_agent(self.name, config)
        self._pool = kv_cache
        self._reg = self._agent.register_memory(kv_cache)
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        self.geometry = pool_geometry(kv_cache)
        self.heads = ranges[rank]
        self.writer = SliceWriter(self._agent, rank, ranges, self.geometry, self._mem_type)
        self._agent.add_remote_agent(rank0_metadata)
        self._tokens: dict[int, _Token] = {}
        self._busy_until = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-rank-{rank}", daemon=True)
        self._thread.start()

    def rank_pool(self) -> RankPool:
        return RankPool(
            self.name,
            self.heads,
            self.geometry.base_addr,
            self.geometry.device_id,
            self._agent.get_agent_metadata(),
        )

    def post(
        self,
        token: int,
        peer: str,
        meta: bytes | None,
        local: np.ndarray,
        remote: np.ndarray,
        deadline: float,
    ) -> None:
        with self.lock:
            if meta is not None:
                self.writer.load(PeerMetadata.from_bytes(meta))
            if self.rank_slices(peer):
                posted = self.writer.post(peer, local, remote, PART_NOTIF + str(token).encode())
                self._tokens[token] = _Token(posted.handles, deadline, posted.error is None)
                if posted.error is not None:
                    log.warning(
                        "KV write %d to %r failed on this rank: %s", token, peer, posted.error
                    )
        self._wake.set()

    def rank_slices(self, peer: str) -> bool:
        return self.writer.knows(peer) and self.writer.rank in self.writer.writers(peer)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        with self.lock:
            for token in self._tokens.values():
                for h in token.handles:
                    _release(h)
            self._tokens.clear()
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as e:  # noqa: BLE001
                log.debug("NIXL deregister on close: %s", e)

    @property
    def num_in_flight(self) -> int:
        return len(self._tokens)

    # -- the polling thread -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                try:
                    self._poll()
                except Exception:  # noqa: BLE001 - keep polling; a write's failure is reported
                    log.exception("KV rank agent poll failed")
                busy = bool(self._tokens) or time.monotonic() < self._busy_until
            self._wake.wait(BUSY_POLL_S if busy else IDLE_POLL_S)
            self._wake.clear()

    def _poll(self) -> None:
        if self._agent.get_new_notifs():  # part notifications of writes into our pool: dropped
            self._busy_until = time.monotonic() + BUSY_AFTER_NOTIF_S
        now = time.monotonic()
        for token_id, token in list(self._tokens.items()):
            states = [_state(self._agent, h) for h in token.handles]
            if "ERR" in states or now >= token.deadline:
                token.ok = False
            elif "PROC" in states:
                continue
            token.handles = [h for h in token.handles if not _release(h)]
            if not token.handles:
                del self._tokens[token_id]
                report = RANK_REPORT + f"{token_id}:{int(token.ok)}".encode()
                try:
                    self._agent.send_notif(self.rank0, report)
                except Exception:  # noqa: BLE001 - rank 0 gone: the group is failing
                    log.exception("cannot report KV write %d to rank 0", token_id)


def _state(agent: Any, handle: Any) -> str:
    try:
        return agent.check_xfer_state(handle)
    except Exception:  # noqa: BLE001
        return "ERR"


def _release(handle: Any) -> bool:
    try:
        handle.release()
        return True
    except Exception as e:  # noqa: BLE001
        log.debug("NIXL handle not released yet: %s", e)
        return False


# -- messages from rank 0 (pickled over the group channel) --------------------------------
@dataclass(frozen=True)
class RegisterRankPool:
    agent_name: str
    """Rank 0's agent name (the worker's); rank r's is `rank_agent_name(agent_name, r)`."""
    ranges: list[HeadRange]
    config: KVTransferConfig
    rank0_metadata: bytes
    gather: bool = True

    def run_on_rank(self, ctx: Any) -> RankPool:
        old = ctx.services.pop(SERVICE, None)
        if old is not None:
            old.close()
        agent = RankAgent(
            self.agent_name,
            ctx.rank,
            self.ranges,
            ctx.kv_cache,
            self.config,
            self.agent_name,
            self.rank0_metadata,
        )
        ctx.services[SERVICE] = agent
        return agent.rank_pool()


@dataclass(frozen=True)
class PostRankWrites:
    token: int
    peer: str
    peer_metadata: bytes | None
    """The peer's metadata when this rank has not been told it yet (or it changed)."""
    local: np.ndarray
    remote: np.ndarray
    deadline: float
    """time.monotonic() of this host (the ranks share rank 0's host)."""
    gather: bool = False

    def run_on_rank(self, ctx: Any) -> None:
        ctx.services[SERVICE].post(
            self.token, self.peer, self.peer_metadata, self.local, self.remote, self.deadline
        )


@dataclass(frozen=True)
class CloseRankAgent:
    gather: bool = False

    def run_on_rank(self, ctx: Any) -> None:
        agent = ctx.services.pop(SERVICE, None)
        if agent is not None:
            agent.close()


@dataclass(frozen=True)
class RankLink:
    """Rank 0's way to its other ranks: every rank's heads, and `call(message)` (broadcast;
    the gathered replies of ranks 1..N-1 for a message with `gather`)."""

    ranges: list[HeadRange]
    call: Any = field(repr=False)
