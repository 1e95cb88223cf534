"""One rank's share of a batch of block writes into a peer worker whose pools hold other
head ranges than ours (a different tensor_parallel_size, or replicated heads), over NIXL.

`SliceWriter` belongs to one NIXL agent (rank 0's transport, or a `RankAgent` on ranks
1..N-1). It loads every rank agent of a peer worker, plans once per peer which heads move
between which ranks (kvtransfer.heads), and posts this rank's slices of a batch: one NIXL
transfer per destination rank it writes into, each carrying a part notification, its block
pairs coalesced into one region per run (kvtransfer/coalesce.py). Two single-pool workers
post through the same writer: one transfer that carries the batch's own notification. NIXL
delivers a notification only after its transfer's data, and a transfer that carries one is
done only once both are out, so a part that is DONE has landed; rank 0 sends the batch's own
notification (the one the receiver counts) only after every part of every rank is DONE.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvtransfer.base import KVTransferConfig
from kvtransfer.errors import KVTransferError, MetadataError
from kvtransfer.heads import HeadRange, PoolGeometry, Slice, plan_slices, slice_descs
from kvtransfer.metadata import PeerMetadata

log = logging.getLogger(__name__)

PART_NOTIF = b"pdkvp1:"
"""Prefix of the notification each part write carries (dropped by every receiver)."""
RANK_REPORT = b"pdkvr1:"
"""Prefix of a rank's report to its rank 0: b'pdkvr1:<token>:<1 ok | 0 failed>', sent once
none of the rank's writes for that token can still move data."""


def rank_agent_name(agent_name: str, rank: int) -> str:
    """The NIXL agent name of rank `rank` of the worker whose rank 0 is `agent_name`."""
    return agent_name if rank == 0 else f"{agent_name}.tp{rank}"


def pool_geometry(kv_cache: Any) -> PoolGeometry:
    """The geometry of a pool tensor [blocks, heads, layers, 2, block_size, head_dim]."""
    _, heads, layers, two, block_size, dim = kv_cache.shape
    base = kv_cache.data_ptr()
    device = kv_cache.get_device() if kv_cache.is_cuda else 0
    return PoolGeometry(
        base, heads, device, layers * two * block_size, dim * kv_cache.element_size()
    )


def make_agent(name: str, config: KVTransferConfig) -> tuple[Any, type]:
    """A NIXL agent with our settings, and the exception NIXL raises for a dead peer."""
    if config.ucx_net_devices is not None:
        os.environ.setdefault("UCX_NET_DEVICES", config.ucx_net_devices)
    # UCX logs to stdout unless told otherwise; a worker's stdout carries its READY line
    # (local_cluster/launcher.py), which a log line written mid-line would garble.
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(
        enable_prog_thread=config.nixl_progress_thread,
        enable_listen_thread=False,
        backends=list(config.nixl_backends),
    )
    agent = nixl_agent(name, conf)
    if not agent.backends:
        raise KVTransferError(f"NIXL could not start any of {config.nixl_backends}")
    return agent, _bindings.nixlRemoteDisconnectError


class Posted(NamedTuple):
    """What `SliceWriter.post` posted of a batch."""

    handles: list[Any]
    error: Exception | None
    """What stopped the rest (None: every transfer was posted)."""
    descriptors: int
    """NIXL descriptors (coalesced regions) of the transfers posted."""
    nbytes: int


@dataclass(slots=True)
class _Peer:
    meta: PeerMetadata
    agents: list[str]
    """Each of the peer's ranks' NIXL agent names, rank 0 first."""
    slices: list[Slice]
    """Every source rank's slices (ours and our other ranks')."""


class SliceWriter:
    """Posts rank `rank`'s slices of each batch; see the module docstring. Not thread-safe:
    its owner serializes calls (the backend's lock, or the rank agent's)."""

    def __init__(
        self, agent: Any, rank: int, ranges: list[HeadRange], own: PoolGeometry, mem_type: str
    ) -> None:
        self._agent = agent
        self.rank = rank
        self.ranges = ranges
        """The heads of each of our worker's ranks."""
        self.own = own
        """Our pool (a pool registered again after a sleep moves: set it anew)."""
        self._mem_type = mem_type
        self._peers: dict[str, _Peer] = {}
        self.descriptors_posted = 0
        """NIXL descriptors this rank posted so far (one per coalesced region)."""

    def load(self, meta: PeerMetadata, first_loaded: bool = False) -> None:
        """Load the peer's rank agents (`first_loaded`: its rank 0 agent already is) and plan
        its slices. MetadataError if NIXL refuses an agent's metadata."""
        self.forget(meta.agent_name)
        blobs = [meta.agent_metadata, *(r.agent_metadata for r in meta.ranks)]
        agents = [meta.agent_name, *(r.agent_name for r in meta.ranks)]
        loaded: list[str] = []
        try:
            for i, (name, blob) in enumerate(zip(agents, blobs)):
                if i == 0 and first_loaded:
                    continue
                got = self._agent.add_remote_agent(blob)
                got = got.decode() if isinstance(got, bytes) else str(got)
                loaded.append(got)
                if got != name:
                    raise MetadataError(
                        f"peer rank metadata names agent {name!r} but its NIXL blob is {got!r}"
                    )
            slices = plan_slices(self.ranges, meta.head_ranges())
        except Exception as e:
            for name in loaded:
                self._remove(name)
            raise (
                e
                if isinstance(e, MetadataError)
                else MetadataError(f"cannot load the ranks of {meta.agent_name!r}: {e}")
            ) from e
        self._peers[meta.agent_name] = _Peer(meta, agents, slices)

    def forget(self, name: str, keep_first: bool = False) -> None:
        peer = self._peers.pop(name, None)
        if peer is not None:
            for i, agent in enumerate(peer.agents):
                if not (i == 0 and keep_first):
                    self._remove(agent)

    def knows(self, name: str) -> bool:
        return name in self._peers

    def slices(self, name: str) -> list[Slice]:
        return self._peers[name].slices

    def writers(self, name: str) -> set[int]:
        """Our ranks that have a slice to write into peer `name`."""
        return {s.src_rank for s in self._peers[name].slices}

    def post(self, name: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> Posted:
        """Post our slices of blocks `local` -> `remote` of peer `name`: one transfer per
        destination rank, each carrying `notif`, its pairs coalesced (heads.slice_descs).
        Returns the handles posted, the error that stopped the rest, and what was posted."""
        peer = self._peers[name]
        mine = [s for s in peer.slices if s.src_rank == self.rank]
        handles: list[Any] = []
        descriptors = nbytes = 0
        try:
            for dst in sorted({s.dst_rank for s in mine}):
                parts = [
                    slice_descs(s, self.own, peer.meta.geometry(dst), local, remote)
                    for s in mine
                    if s.dst_rank == dst
                ]
                src = np.concatenate([p[0] for p in parts])
                dst_descs = np.concatenate([p[1] for p in parts])
                handle = self._agent.initialize_xfer(
                    "WRITE",
                    self._agent.get_xfer_descs(src, self._mem_type),
                    self._agent.get_xfer_descs(dst_descs, peer.meta.mem_type),
                    peer.agents[dst],
                    notif,
                )
                handles.append(handle)
                descriptors += len(src)
                nbytes += int(src[:, 1].sum())
                if self._agent.transfer(handle) == "ERR":
                    raise RuntimeError("NIXL refused to post the write")
        except Exception as e:  # noqa: BLE001 - reported per request
            return self._posted(handles, e, descriptors, nbytes)
        return self._posted(handles, None, descriptors, nbytes)

    def _posted(
        self, handles: list[Any], error: Exception | None, descriptors: int, nbytes: int
    ) -> Posted:
        self.descriptors_posted += descriptors
        return Posted(handles, error, descriptors, nbytes)

    def _remove(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001
            log.debug("NIXL remove_remote_agent(%r): %s", name, e)
