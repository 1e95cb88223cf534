"""The workers registered in this worker's cluster, as KV peers: the only agents KV may be
written into, and the ones connected ahead of their first transfer.

KV leaves a worker only for an agent that a registration in etcd names (a prefill worker
streaming into its decode worker, a holder sending blocks a peer pulls). `check` refuses any
other destination; `warm_forever` learns the registrations every second and adds each other
worker's agent as a transfer peer (compatibility check and connection) before it is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cluster.registration import WorkerInfo, list_workers, make_client
from kvtransfer import IncompatiblePeerError
from worker_runtime.contexts import PeerContext
from worker_runtime.grpc_errors import PermissionDenied, Unavailable

log = logging.getLogger(__name__)


class RegisteredPeers:
    def __init__(self, ctx: PeerContext) -> None:
        self.ctx = ctx
        self._registered: set[bytes] = set()
        """KV agents (NIXL metadata) of the workers registered in etcd."""
        self._etcd = None
        """One etcd client for every look at the registrations, kept while it works: a new
        client per look would sign in to etcd every second (a bcrypt check there each time,
        ~0.1 s of etcd's CPU at its default cost)."""
        self._etcd_lock = asyncio.Lock()

    async def check(self, peer_metadata: bytes) -> None:
        """KV is written only into a worker registered in this cluster: a destination whose
        agent no registration names (after one fresh look at etcd: a worker that just woke
        up publishes new metadata) is refused before anything is sent."""
        if peer_metadata in self._registered:
            return
        try:
            await self._refresh()
        except Exception as exc:
            raise Unavailable(f"cannot check the destination against etcd: {exc!r}") from None
        if peer_metadata not in self._registered:
            raise PermissionDenied(
                "destination.peer_metadata names no worker registered in "
                f"cluster {self.ctx.cluster!r}"
            )

    async def warm_forever(self) -> None:
        """Every second: learn the registered workers' KV agents and add every other worker
        as a transfer peer ahead of its first transfer (whatever role either serves: decode
        workers receive prompts, and any worker may pull blocks this one holds)."""
        known: set[str] = set()
        try:
            while True:
                try:
                    for info in await self._refresh():
                        if (
                            info.kv_metadata
                            and info.worker_id != self.ctx.worker_id()
                            and info.kv_metadata not in known
                        ):
                            await self._add(info, known)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.debug("peer warm-up: etcd not reachable (%r)", exc)
                await asyncio.sleep(1.0)
        finally:
            await self._drop_etcd()

    async def _add(self, info: WorkerInfo, known: set[str]) -> None:
        try:
            await asyncio.to_thread(self.ctx.add_peer, info.kv_metadata.encode("ascii"))
            known.add(info.kv_metadata)
        except IncompatiblePeerError as exc:  # its KV format differs: say it once
            known.add(info.kv_metadata)
            log.warning("worker %s is not a KV peer: %s", info.worker_id, exc)
        except Exception as exc:
            log.warning("cannot add worker %s as a KV peer: %s", info.worker_id, exc)

    async def _refresh(self) -> list[WorkerInfo]:
        async with self._etcd_lock:
            if self._etcd is None:
                client = make_client(self.ctx.etcd, self.ctx.etcd_credentials)
                await client.connect()
                self._etcd = client
            client = self._etcd
        try:
            workers = await list_workers(client, self.ctx.cluster)
        except Exception:
            await self._drop_etcd(client)  # the next look connects afresh
            raise
        self._registered = {w.kv_metadata.encode("ascii") for w in workers if w.kv_metadata}
        return workers

    async def _drop_etcd(self, client=None) -> None:
        """Close the etcd client (`client`: only if it is still the current one)."""
        async with self._etcd_lock:
            if self._etcd is None or (client is not None and client is not self._etcd):
                return
            client, self._etcd = self._etcd, None
        with contextlib.suppress(Exception):
            await client.close()
