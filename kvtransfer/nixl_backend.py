"""The NIXL backend: one-sided WRITEs of whole blocks into a peer's pool, over UCX.

The pool is registered as one region; both pools are described block by block (one
descriptor per block, prepared once: ours at registration, a peer's when it is added), so a
batch is `make_prepped_xfer(WRITE, our indices, their indices, notification)` with its pairs
in source block order: NIXL merges consecutive descriptors that are contiguous on both sides
(makeXferReq's descriptor merge, on by default in 1.5.1), so a run of blocks adjacent in both
pools moves as one region (the block pool hands out runs: engine/kv/block_pool.py). Measured
against building the coalesced descriptors per batch (`initialize_xfer`): 1.5 us against 15 us
per post, the same regions (docs/benchmarks/kvtransfer.md). Works the same for CPU (DRAM) and
CUDA (VRAM) pools; UCX picks the path (CMA on one host, RDMA/NVLink/cuda_ipc on GPU
machines). Every post is counted in the sender's metrics (regions, bytes, post time:
kvtransfer/metrics.py).

Progress: no NIXL thread. UCX advances only inside our calls, so the worker's loop calls
`sender.poll()` / `receiver.poll()` every step, and its transfer-progress thread between steps
(kvtransfer/progress.py; each poll is a few microseconds when idle). On one
host UCX writes with CMA, which copies inside the posting call: `send` returns after its batch
is copied, so keep batches to what one engine step produced. A batch's flush and notification
complete only once the receiver has polled (UCX's `peer` error-handling mode, which the
dead-peer detection below needs: with mode `none` the sender completes in ~1 ms without the
receiver, measured), so the sender's COMPLETE trails the receiver's poll period
(kvtransfer/progress.py: a listening receiver polls at least every 5 ms). The copy itself is
the kernel's (process_vm_writev, cached stores): ~0.97x of that copy in-process, ~0.4x of a
libc memcpy with non-temporal stores (docs/benchmarks/kvtransfer.md, 2026-12-08).
NIXL's own progress thread (`KVTransferConfig.nixl_progress_thread`) spins without delay and
is off by default.

Tensor-parallel workers and heterogeneous peers (nixl_slices.py, rank_agent.py): when our
pools or the peer's hold other head ranges than one whole pool each, a batch is posted as
parts — every rank of ours that holds a needed slice writes it into the peer ranks that need
it (ranks 1..N-1 are told over the group channel and report back with a notification); the
batch is done, and its notification sent to the peer's rank 0, only once every part is done.
Two single-pool workers keep the one prepared transfer per batch described above.

Dead peers: posting to, or notifying, a peer whose process died raises
NIXL_ERR_REMOTE_DISCONNECT (UCX notices the closed socket within milliseconds on one host);
the request fails and the peer is marked dead. Writes that hang without an error are ended
by the request's deadline, which releases (cancels) their handles.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer.backend import TransportBackend
from kvtransfer.base import KVTransferConfig
from kvtransfer.coalesce import by_source, count_runs
from kvtransfer.errors import MetadataError
from kvtransfer.heads import HeadRange
from kvtransfer.metadata import PeerMetadata, RankPool
from kvtransfer.nixl_slices import PART_NOTIF, RANK_REPORT, SliceWriter, make_agent, pool_geometry
from kvtransfer.rank_agent import CloseRankAgent, PostRankWrites, RankLink, RegisterRankPool
from kvtransfer.transport import Transport, TransportError, WriteState

log = logging.getLogger(__name__)

_STATES = {"DONE": WriteState.DONE, "PROC": WriteState.PROC}


def block_descs(base_addr: int, num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
    """NIXL descriptors (address, length, device) of every block of a block-major pool."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base_addr) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(
        block_bytes
    )
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


@dataclass(slots=True)
class _Parts:
    """One batch posted as parts: our handles, `num_ranks` other ranks' reports awaited
    under `token`, and the batch notification sent once everything is done."""

    peer: str
    handles: list[Any]
    token: int
    num_ranks: int
    notif: bytes
    failed: bool = False
    state: WriteState = WriteState.PROC


class NixlTransport(Transport):
    name = "nixl"

    def __init__(
        self, agent_name: str, config: KVTransferConfig, group: RankLink | None = None
    ) -> None:
        self._name, self._config, self._group = agent_name, config, group
        self._agent, self._disconnect_error = make_agent(agent_name, config)
        self._reg: Any = None
        self._local: Any = None
        self._block_bytes = 0
        self._mem_type = "DRAM"
        self._remote: dict[str, Any] = {}
        self._peer_meta: dict[str, PeerMetadata] = {}
        self._slices: SliceWriter | None = None
        self._rank_pools: tuple[RankPool, ...] = ()
        self._told: dict[str, PeerMetadata] = {}
        """The peer metadata each of our other ranks has been sent."""
        self._tokens = itertools.count(1)
        self._reports: dict[int, list[bool]] = {}
        """Our other ranks' reports per parts token (rank_agent.py)."""

    @property
    def _writer(self) -> SliceWriter:
        """The slice writer, made by `register_pool` (which every peer comes after)."""
        assert self._slices is not None, "register_pool comes first"
        return self._slices

    @property
    def heads(self) -> HeadRange | None:
        """Our (rank 0's) heads when we are a tensor-parallel worker; None: every head."""
        return None if self._group is None else self._group.ranges[0]

    def rank_pools(self) -> tuple[RankPool, ...]:
        return self._rank_pools

    def register(self, kv_cache: Any, block_bytes: int) -> bytes:
        self._mem_type = "VRAM" if kv_cache.is_cuda else "DRAM"
        device = kv_cache.get_device() if kv_cache.is_cuda else 0
        self._reg = self._agent.register_memory(kv_cache)
        descs = block_descs(kv_cache.data_ptr(), kv_cache.shape[0], block_bytes, device)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self._mem_type)
        self._block_bytes = block_bytes
        blob = self._agent.get_agent_metadata()
        ranges = [HeadRange(0, kv_cache.shape[1])] if self._group is None else self._group.ranges
        if self._slices is None:
            self._slices = SliceWriter(
                self._agent, 0, ranges, pool_geometry(kv_cache), self._mem_type
            )
        self._slices.own = pool_geometry(kv_cache)  # peers stay connected across a re-register
        if self._group is not None:
            pools = self._group.call(RegisterRankPool(self._name, ranges, self._config, blob))
            self._rank_pools = tuple(pools)
            for pool in self._rank_pools:  # our ranks report to us
                self._agent.add_remote_agent(pool.agent_metadata)
        return blob

    def connect(self, meta: PeerMetadata) -> None:
        try:
            loaded = self._agent.add_remote_agent(meta.agent_metadata)
        except Exception as e:
            raise MetadataError(f"NIXL refused the metadata of {meta.agent_name!r}: {e}") from e
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != meta.agent_name:
            self._forget(name)
            raise MetadataError(
                f"peer metadata names agent {meta.agent_name!r} but its NIXL blob is {name!r}"
            )
        descs = block_descs(
            meta.base_addr, meta.num_blocks, meta.geometry(0).block_bytes, meta.device_id
        )
        try:
            self._remote[name] = self._agent.prep_xfer_dlist(name, descs, meta.mem_type)
        except Exception as e:
            self._forget(name)
            raise MetadataError(
                f"the pool described by {name!r}'s metadata is not registered memory of that "
                f"agent: {e}"
            ) from e
        try:
            self._writer.load(meta, first_loaded=True)
        except MetadataError:
            self.disconnect(name)
            raise
        self._peer_meta[name] = meta
        try:
            self._agent.make_connection(name)
        except Exception as e:  # reported per request by the first write
            log.warning("NIXL could not pre-connect to %r: %s", name, e)

    def disconnect(self, name: str) -> None:
        handle = self._remote.pop(name, None)
        if handle is not None:
            handle.release()
        self._peer_meta.pop(name, None)
        if self._slices is not None:
            self._slices.forget(name, keep_first=True)
        self._forget(name)

    def post_write(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes, deadline: float
    ) -> Any:
        slices = self._writer.slices(peer)
        if self._group is not None or len(slices) != 1 or not slices[0].whole:
            return self._post_parts(peer, local, remote, notif, deadline)
        started = time.perf_counter()
        # In source block order, a run of blocks adjacent on both sides is consecutive in both
        # prepared lists: NIXL merges such descriptors into one region (makeXferReq's merge).
        local, remote = by_source(local, remote)
        handle = None
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                self._local,
                local.astype(np.int32),
                self._remote[peer],
                remote.astype(np.int32),
                notif,
            )
            state = self._agent.transfer(handle)
        except Exception as e:
            if handle is not None and not self.release(handle):
                log.error("leaking a NIXL handle that failed to post")
            raise TransportError(str(e), disconnected=isinstance(e, self._disconnect_error)) from e
        if state == "ERR":
            self.release(handle)
            raise TransportError("NIXL refused to post the write")
        self._record_post(count_runs(local, remote), len(local) * self._block_bytes, started)
        return handle

    def _record_post(self, descriptors: int, nbytes: int, started: float) -> None:
        self.descriptors_posted += descriptors
        if self.metrics is not None:
            self.metrics.record_post(descriptors, nbytes, time.perf_counter() - started)

    def _post_parts(
        self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes, deadline: float
    ) -> _Parts:
        token = next(self._tokens)
        others = self._writer.writers(peer) - {0}
        if others:
            assert self._group is not None  # only a tensor-parallel group has other writers
            meta = self._peer_meta[peer]
            told = self._told.get(peer) == meta
            try:
                self._group.call(
                    PostRankWrites(
                        token, peer, None if told else meta.to_bytes(), local, remote, deadline
                    )
                )
            except Exception as e:  # the group failed: nothing of ours is posted
                raise TransportError(f"tensor-parallel ranks unreachable: {e}") from e
            self._told[peer] = meta
            self._reports[token] = []
        started = time.perf_counter()
        handles, error, descriptors, nbytes = self._writer.post(
            peer, local, remote, PART_NOTIF + str(token).encode()
        )
        if error is not None and not handles and not others:
            raise TransportError(str(error), disconnected=isinstance(error, self._disconnect_error))
        if error is not None:
            log.warning("KV write to %r failed: %s", peer, error)
        else:
            self._record_post(descriptors, nbytes, started)
        return _Parts(peer, handles, token, len(others), notif, failed=error is not None)

    def check(self, handle: Any) -> WriteState:
        if isinstance(handle, _Parts):
            return self._check_parts(handle)
        try:
            return _STATES.get(self._agent.check_xfer_state(handle), WriteState.ERR)
        except Exception:
            return WriteState.ERR

    def release(self, handle: Any) -> bool:
        if isinstance(handle, _Parts):
            return self._release_parts(handle)
        try:
            handle.release()
            return True
        except Exception as e:
            log.debug("NIXL handle not released yet: %s", e)
            return False

    def send_notif(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as e:
            raise TransportError(str(e), disconnected=isinstance(e, self._disconnect_error)) from e

    def fetch_notifs(self) -> list[tuple[str, bytes]]:
        out = []
        for agent, msgs in self._agent.get_new_notifs().items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            for msg in msgs:
                if msg.startswith(PART_NOTIF):
                    continue  # a part of a sliced batch: its batch notification follows
                if msg.startswith(RANK_REPORT) and any(
                    p.agent_name == agent for p in self._rank_pools
                ):
                    self._on_report(msg)
                    continue
                out.append((agent, msg))
        return out

    # -- batches posted as parts (tensor-parallel workers, heterogeneous peers) ----------
    def _on_report(self, msg: bytes) -> None:
        try:
            token, ok = msg[len(RANK_REPORT) :].decode().split(":")
            reports = self._reports.get(int(token))
        except ValueError:
            log.warning("malformed report from a tensor-parallel rank: %r", msg)
            return
        if reports is not None:
            reports.append(ok == "1")

    def _check_parts(self, parts: _Parts) -> WriteState:
        if parts.state is not WriteState.PROC:
            return parts.state
        states = [self.check(h) for h in parts.handles]
        reports = self._reports.get(parts.token, [])
        if parts.failed or WriteState.ERR in states or not all(reports):
            parts.state = WriteState.ERR
        elif WriteState.PROC not in states and len(reports) == parts.num_ranks:
            try:  # every part landed: the batch's own notification
                self.send_notif(parts.peer, parts.notif)
                parts.state = WriteState.DONE
            except TransportError as e:
                log.warning("KV batch notification to %r failed: %s", parts.peer, e)
                parts.state = WriteState.ERR
        return parts.state

    def _release_parts(self, parts: _Parts) -> bool:
        parts.handles = [h for h in parts.handles if not self.release(h)]
        if parts.handles or len(self._reports.get(parts.token, [])) < parts.num_ranks:
            return False  # a write of ours or of another rank may still move data
        self._reports.pop(parts.token, None)
        return True

    def deregister(self) -> None:
        self._close_ranks()
        if self._local is not None:
            self._local.release()
            self._local = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

    def close(self) -> None:
        self._close_ranks()
        for name in list(self._remote):
            self.disconnect(name)
        if self._local is not None:
            self._local.release()
            self._local = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None

    def _close_ranks(self) -> None:
        if self._rank_pools:
            assert self._group is not None  # rank pools come from the group
            self._rank_pools = ()
            self._told.clear()
            try:
                self._group.call(CloseRankAgent())
            except Exception as e:  # noqa: BLE001 - the group is gone: so are its agents
                log.debug("closing the ranks' KV agents: %s", e)

    def _forget(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            log.debug("NIXL remove_remote_agent(%r): %s", name, e)


class NixlTransferBackend(TransportBackend):
    """KVTransferBackend over NIXL; see `kvtransfer.base` for the contract. `group`: this is
    rank 0 of a tensor-parallel worker (its other ranks get agents of their own)."""

    def __init__(
        self, config: KVTransferConfig | None = None, group: RankLink | None = None
    ) -> None:
        config = config or KVTransferConfig()
        name = config.agent_name or f"pdserve-{uuid.uuid4().hex[:12]}"
        super().__init__(NixlTransport(name, config, group), name, config)
