"""Live workers of one cluster, as etcd says, plus what this router knows about its own load
on them.

`WorkerRegistry` is plain state (put / delete / replace_all, listeners, a change signal);
`EtcdWatcher` drives it: list the prefix, watch from the next revision, and on any error or
silence reconnect and re-list, so a router restart or an etcd outage ends in the same state.
A worker disappears when its lease lapses (etcd deletes the key); a worker whose registration
was not republished for `stale_after_s` stays listed but gets no new work (`stale`).
A worker that switches roles (`Worker.SetRole`) moves from one role's key to the other's at
the same address: it stays registered (its KV-index entries and this router's load on it are
kept), and the delete of its old key — before or after the new key arrives — does not remove
it under its new role.
A registration can be refused (`refused`, by reason): one whose block-hash probe disagrees with
this router's hashing (cluster/block_hash_agreement.py), and whatever the router's `refusal`
says (another model, an address outside --allowed-worker-cidrs). A refused worker is not
listed: it gets no request and no KV-index subscription. A registration that does not fit
cluster/registration_check.py (types, ranges, lengths, its key) is refused whole and logged
with its key. A worker first seen draining is listed but gets no channel from this router (no
KV subscription: the cluster token goes only to workers seen ready) until it stops draining.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from cluster.block_hash_agreement import REASON as BLOCK_HASH_MISMATCH
from cluster.block_hash_agreement import probe_refusal
from cluster.etcd_security import EtcdCredentials
from cluster.registration import (
    WorkerInfo,
    make_client,
    parse_registration,
    registration_key,
    workers_prefix,
)
from cluster.retry import reconnect_forever
from cluster.roles import Role

log = logging.getLogger(__name__)

Listener = Callable[[WorkerInfo], None]


class Refusal(NamedTuple):
    """Why a registration is ignored."""

    reason: str
    """Short, for the metric label: block_hash_mismatch, or what the router's check says."""
    detail: str
    """For the log: what exactly disagrees."""


@dataclass(slots=True)
class WorkerState:
    info: WorkerInfo
    seen_at: float  # router clock (monotonic) when this registration was last republished
    inflight: int = 0  # requests this router has on the worker (decode)
    inflight_prefill_tokens: int = 0  # prompt tokens sent that have no first token yet (prefill)
    announced: bool = False  # the added-listeners were told (it has been seen not draining)


class WorkerRegistry:
    def __init__(
        self,
        stale_after_s: float = 2.0,
        refusal: Callable[[WorkerInfo], Refusal | str | None] = lambda info: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`refusal(info)`: why a registration is ignored (another model, an address outside
        --allowed-worker-cidrs; a plain string has the reason "refused"), None to accept it.
        A registration whose block-hash probe disagrees is refused before it is asked."""
        self.stale_after_s = stale_after_s
        self.refusal = refusal
        self.clock = clock
        self._workers: dict[str, WorkerState] = {}
        self._on_added: list[Listener] = []
        self._on_removed: list[Listener] = []
        self._on_new_weights: list[Listener] = []
        self._changed = asyncio.Event()
        self.refused: dict[str, Refusal] = {}
        """Worker id -> why its registration is ignored (logged once per worker)."""
        self.synced = asyncio.Event()  # set once the first full listing was applied

    def add_listener(self, on_added: Listener, on_removed: Listener) -> None:
        """`on_added(info)` once a listed worker is seen not draining (see `_announce`),
        `on_removed(info)` when such a worker leaves."""
        self._on_added.append(on_added)
        self._on_removed.append(on_removed)

    def add_weights_listener(self, on_new_weights: Listener) -> None:
        """`on_new_weights(info)` when a registered worker republishes another weights version."""
        self._on_new_weights.append(on_new_weights)

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def by_role(self, role: Role) -> list[WorkerState]:
        return [w for w in self._workers.values() if w.info.role == role]

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def is_stale(self, state: WorkerState, now: float | None = None) -> bool:
        return (self.clock() if now is None else now) - state.seen_at > self.stale_after_s

    def state_of(self, state: WorkerState, now: float | None = None) -> str:
        """ready | draining | stale (only ready workers take new requests)."""
        if state.info.draining:
            return "draining"
        return "stale" if self.is_stale(state, now) else "ready"

    def ready(self, role: Role) -> list[WorkerState]:
        now = self.clock()
        return [w for w in self.by_role(role) if self.state_of(w, now) == "ready"]

    def _refusal_of(self, info: WorkerInfo) -> Refusal | None:
        detail = probe_refusal(info)
        if detail is not None:
            return Refusal(BLOCK_HASH_MISMATCH, detail)
        refusal = self.refusal(info)
        return Refusal("refused", refusal) if isinstance(refusal, str) else refusal

    def put(self, info: WorkerInfo) -> None:
        refusal = self._refusal_of(info)
        if refusal is not None:
            if info.worker_id in self._workers:  # its registration changed: no longer accepted
                self.delete(info.worker_id)
            if info.worker_id not in self.refused:
                log.warning(
                    "ignoring worker %s (%s): %s", info.worker_id, info.role, refusal.detail
                )
            self.refused[info.worker_id] = refusal
            return
        self.refused.pop(info.worker_id, None)
        old = self._workers.get(info.worker_id)
        if old is not None and old.info.grpc_address != info.grpc_address:
            self.delete(info.worker_id)  # restarted elsewhere: a new worker
            old = None
        if old is not None and old.info.role != info.role:
            log.info(
                "worker %s switched from the %s role to the %s role",
                info.worker_id,
                old.info.role,
                info.role,
            )
        if old is None:
            # First sight (possibly an old listing): as fresh as its publication time says.
            age = max(0.0, time.time() - info.updated_at) if info.updated_at else 0.0
            state = self._workers[info.worker_id] = WorkerState(info, self.clock() - age)
            log.info(
                "worker %s (%s, KV %s) at %s joined%s",
                info.worker_id,
                info.role,
                info.kv_cache_dtype,
                info.grpc_address,
                " draining" if info.draining else "",
            )
            self._warn_unpaired(info)
            self._announce(state)
        else:
            if info.updated_at != old.info.updated_at:  # republished, not merely re-listed
                old.seen_at = self.clock()
            new_weights = old.info.weights_version != info.weights_version
            old.info = info
            self._announce(old)
            if new_weights and old.announced:
                log.info(
                    "worker %s now runs weights version %d", info.worker_id, info.weights_version
                )
                for listener in self._on_new_weights:
                    listener(info)
        self.notify()

    def _announce(self, state: WorkerState) -> None:
        """Tell the added-listeners (the KV subscription: a channel carrying the cluster
        token) about a worker once it is seen not draining: one that registers draining gets
        no channel from this router, which placed nothing on it."""
        if not state.announced and not state.info.draining:
            state.announced = True
            for listener in self._on_added:
                listener(state.info)

    def _warn_unpaired(self, info: WorkerInfo) -> None:
        """A joining worker whose KV layout (compat hash: model, KV cache dtype and scales,
        block size) no worker of the other role shares never pairs with them: say so once."""
        other = [w.info for w in self._workers.values() if w.info.role != info.role]
        if other and all(o.compat_hash != info.compat_hash for o in other):
            log.warning(
                "worker %s (%s, KV %s, block size %d) shares its KV layout with no %s "
                "worker (%s): no KV transfers between them",
                info.worker_id,
                info.role,
                info.kv_cache_dtype,
                info.block_size,
                other[0].role,
                ", ".join(
                    sorted(
                        {
                            f"{o.worker_id}: KV {o.kv_cache_dtype}, block size {o.block_size}"
                            for o in other
                        }
                    )
                ),
            )

    def delete(self, worker_id: str, role: str | None = None) -> None:
        """The worker left; with `role` (its key's), only if it is registered in that role
        (the old key of a worker that switched roles is deleted after the new one is put)."""
        state = self._workers.get(worker_id)
        if state is not None and role is not None and state.info.role != role:
            return
        self._workers.pop(worker_id, None)
        self.refused.pop(worker_id, None)
        if state is None:
            return
        log.info("worker %s (%s) left", worker_id, state.info.role)
        if state.announced:
            for listener in self._on_removed:
                listener(state.info)
        self.notify()

    def replace_all(self, infos: list[WorkerInfo]) -> None:
        """A full listing: workers not in it are gone."""
        present = {i.worker_id for i in infos}
        for worker_id in [w for w in self._workers if w not in present]:
            self.delete(worker_id)
        for worker_id in [w for w in self.refused if w not in present]:
            del self.refused[worker_id]
        for info in infos:
            self.put(info)
        self.synced.set()
        self.notify()

    def notify(self) -> None:
        """Wake everyone waiting for a change (new worker, new capacity, finished request)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()
        except TimeoutError:
            pass


parse_key = registration_key
"""(role, worker_id) of a registration key, None for keys of other shapes."""


class EtcdWatcher:
    """Keeps a WorkerRegistry equal to the registrations under the cluster's prefix."""

    def __init__(
        self,
        registry: WorkerRegistry,
        endpoint: str,
        cluster: str,
        resync_after_s: float = 5.0,
        credentials: EtcdCredentials | None = None,
    ) -> None:
        self.registry = registry
        self.endpoint = endpoint
        self.credentials = credentials
        self.prefix = workers_prefix(cluster)
        self.resync_after_s = resync_after_s

    async def run(self) -> None:
        await reconnect_forever(self._session, f"etcd watch at {self.endpoint}", log)

    async def _session(self) -> None:
        async with make_client(self.endpoint, self.credentials) as client:
            await self._sync_and_watch(client)

    async def _sync_and_watch(self, client) -> None:
        listing = await client.get_prefix(self.prefix)
        parsed = (parse_registration(kv.key, kv.value, self.prefix) for kv in listing)
        self.registry.replace_all([info for info in parsed if info is not None])
        watch = await client.watch_prefix(self.prefix, start_revision=listing.header.revision + 1)
        events = aiter(watch)
        try:
            while True:
                try:
                    # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a
                    # cancellation that races with a completing event (and never stop).
                    async with asyncio.timeout(self.resync_after_s):
                        event = await anext(events)
                except TimeoutError:
                    return  # silence: workers republish often, so re-list to be sure
                self._apply(event)
        finally:
            await watch.cancel()

    def _apply(self, event) -> None:
        parsed = parse_key(event.kv.key, self.prefix)
        if parsed is None:
            return
        if event.kind == "DELETE":
            self.registry.delete(parsed[1], role=parsed[0])
            return
        info = parse_registration(event.kv.key, event.kv.value, self.prefix)
        if info is None:  # refused whole (logged); an accepted earlier version leaves
            self.registry.delete(parsed[1], role=parsed[0])
        else:
            self.registry.put(info)
