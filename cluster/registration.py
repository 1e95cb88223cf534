"""Worker registration in etcd.

Key: `/pdserve/<cluster>/workers/<role>/<worker_id>`, value: WorkerInfo as JSON, bound to a
lease of a few seconds that the worker keeps alive. A worker that dies stops refreshing and
its key disappears when the lease lapses; the router watches the prefix. Capacity is
re-published several times per second (same key, same lease). A worker that switches roles
(`Worker.SetRole`) moves to the new role's key on the same lease: `Registrar.move`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable

from cluster.etcd_client import make_client
from cluster.etcd_security import EtcdCredentials
from cluster.registration_check import (
    MAX_DOCUMENT_BYTES,
    SELFTEST_PATH_CHARS,
    InvalidRegistration,
    check_registration,
)
from cluster.retry import Backoff, reconnect_forever
from cluster.roles import ROLES

log = logging.getLogger(__name__)


class EtcdUnavailable(RuntimeError):
    """etcd could not be reached."""


class RegistrationRefused(RuntimeError):
    """The startup check refused this worker's registration (not retried: exit code 2)."""


@dataclass(frozen=True)
class Capacity:
    """A worker's load and speed as last measured. Every field has a default, so a document
    from an older worker parses (its missing measurements read as "not measured", 0), and
    `from_dict` ignores fields it does not know (a newer worker's)."""

    total_blocks: int = 0
    free_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0  # prompt tokens admitted but not yet computed
    prefill_tokens_per_s: float = 0.0
    """Prompt tokens per second of the recent steps that computed prompt tokens (on a decode
    worker: mixed with its decodes); 0 until measured."""
    # Step timings (engine/engine_loop.py StepTimings): means over recent engine steps, 0
    # until measured. Steps without prompt tokens ("decode steps") and with ("prefill steps");
    # together they give the cost of a step of any size (router/placement/estimates.py).
    decode_step_s: float = 0.0
    decode_step_tokens: float = 0.0
    prefill_step_s: float = 0.0
    prefill_step_tokens: float = 0.0
    """Tokens computed in a prefill step: its prompt tokens + the decodes beside them."""
    max_num_batched_tokens: int = 0
    """The engine's token budget per step (0: not published)."""
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one request computes per step (0: the budget only)."""
    kv_offload_total_blocks: int = 0
    """Blocks its second KV tier (--kv-offloading-size) holds at most (0: no tier)."""
    kv_offload_used_blocks: int = 0
    """Blocks its second KV tier holds now."""
    kv_promote_s_per_block: float = 0.0
    """Mean seconds to promote one block from its second tier into its pool; 0 until measured."""
    kv_pull_blocks_per_s: float = 0.0
    """Blocks per second of its pulls from peers beyond their fixed part (worker_runtime/
    pull_cost.py); 0 until measured."""
    kv_pull_overhead_s: float = 0.0
    """Seconds one pull takes whatever its size (calls, the holder's step, adoption); 0 until
    measured."""

    @classmethod
    def from_dict(cls, doc: dict) -> "Capacity":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in known})


@dataclass(frozen=True)
class TransferSelftest:
    """The worker's KV transfer self-test at start (kvtransfer/selftest.py), as published:
    rates in GB/s; a failed test has 0 rates and `path` "failed: <why>"."""

    gbps: float
    memcpy_gbps: float
    ratio: float
    """gbps / memcpy_gbps: well below 1 means a slow or fallback path (docs/kvtransfer.md)."""
    path: str

    @classmethod
    def published(
        cls, gbps: float, memcpy_gbps: float, ratio: float, path: str
    ) -> "TransferSelftest":
        """What a worker publishes: `path` as one printable line of at most
        SELFTEST_PATH_CHARS (a failure's reason may be a long, multi-line message), so the
        registration passes every reader's check (cluster/registration_check.py)."""
        line = "".join(c if c.isprintable() else " " for c in path)
        return cls(gbps, memcpy_gbps, ratio, line[:SELFTEST_PATH_CHARS])

    @classmethod
    def from_dict(cls, doc: dict) -> "TransferSelftest":
        return cls(
            float(doc["gbps"]), float(doc["memcpy_gbps"]), float(doc["ratio"]), str(doc["path"])
        )


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode
    grpc_address: str  # host:port
    model_id: str
    compat_hash: str  # kvtransfer compatibility hash (model, KV format, block size, layout)
    block_size: int
    kv_metadata: str = ""  # the kvtransfer peer metadata (JSON, ASCII)
    metrics_address: str = ""  # host:port of /metrics
    draining: bool = False
    capacity: Capacity = field(default_factory=Capacity)
    updated_at: float = 0.0  # unix time of this publication
    max_model_len: int = 0  # longest prompt + output the worker holds; 0 = not published
    loras: dict[str, str] = field(default_factory=dict)
    """LoRA adapters this worker serves, name -> path (--lora-modules + LoadLoRAAdapter)."""
    resident_loras: tuple[str, ...] = ()
    """Names of the adapters loaded in its engine now (served or loaded on demand by a
    request); a request with one of them starts without loading it (router affinity)."""
    kv_cache_dtype: str = "auto"
    """How its pool stores K/V (normalized: auto, fp8_e4m3, fp8_e5m2, int8). A quantized one
    enters its prefix-cache block hashes, so the router hashes prompts with it."""
    weights_version: int = 0
    """Bumped by every weight update (Worker.UpdateWeights); part of its block hashes, so the
    router hashes prompts with it, drops its KV-index entries of an older version, and pairs
    a prefill with a decode worker only when their versions agree."""
    sleeping: bool = False
    """Its engine sleeps (Worker.Sleep): it refuses requests until woken up."""
    block_hash_probe: str = ""
    """`engine.kv.block_hash.block_hash_probe` of its block size, KV cache dtype and weights
    version, computed by its own code; "" from workers older than the probe. A worker whose
    probe differs from the router's is refused (cluster/block_hash_agreement.py)."""
    transfer_selftest: TransferSelftest | None = None
    """Its KV transfer self-test at start; None (absent from the document): not run
    (`--no-kv-transfer-selftest`, or a worker older than the self-test)."""

    def to_json(self) -> bytes:
        doc = asdict(self)
        if self.transfer_selftest is None:  # optional: absent rather than null
            del doc["transfer_selftest"]
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, key: tuple[str, str] | None = None) -> "WorkerInfo":
        """Parse a registration, checked whole first (cluster/registration_check.py:
        InvalidRegistration, a ValueError, names the field that does not fit); `key`: the
        (role, worker id) of the etcd key it was found under, which it must agree with."""
        if len(data) > MAX_DOCUMENT_BYTES:
            raise InvalidRegistration(f"{len(data)} bytes (at most {MAX_DOCUMENT_BYTES})")
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise InvalidRegistration(f"not JSON: {exc}") from None
        check_registration(doc, key)
        doc["capacity"] = Capacity.from_dict(doc.get("capacity", {}))
        if doc.get("transfer_selftest") is not None:
            doc["transfer_selftest"] = TransferSelftest.from_dict(doc["transfer_selftest"])
        doc["resident_loras"] = tuple(doc.get("resident_loras", ()))
        return cls(**{k: v for k, v in doc.items() if k in _FIELDS})


_FIELDS = frozenset(f.name for f in fields(WorkerInfo))


def registration_key(key: bytes, prefix: bytes) -> tuple[str, str] | None:
    """(role, worker_id) of a registration key under `prefix`, None for keys of other
    shapes."""
    role, _, worker_id = key[len(prefix) :].decode(errors="replace").partition("/")
    return (role, worker_id) if role in ROLES and worker_id else None


def parse_registration(key: bytes, value: bytes, prefix: bytes) -> WorkerInfo | None:
    """The registration under `key`, None (logged with the key) when it does not fit
    cluster/registration_check.py or does not agree with its key."""
    try:
        return WorkerInfo.from_json(value, registration_key(key, prefix))
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring malformed registration %s: %s", key.decode(errors="replace"), exc)
        return None


def workers_prefix(cluster: str) -> bytes:
    return f"/pdserve/{cluster}/workers/".encode()


def worker_key(cluster: str, role: str, worker_id: str) -> bytes:
    return workers_prefix(cluster) + f"{role}/{worker_id}".encode()


async def list_workers(client, cluster: str) -> list[WorkerInfo]:
    prefix = workers_prefix(cluster)
    listing = await client.get_prefix(prefix)
    parsed = (parse_registration(kv.key, kv.value, prefix) for kv in listing)
    return [info for info in parsed if info is not None]


class Registrar:
    """Keeps one worker registered: lease + periodic publication, re-registering after etcd
    comes back. `info()` is called for every publication (fresh capacity)."""

    def __init__(
        self,
        endpoint: str,
        cluster: str,
        info: Callable[[], WorkerInfo],
        ttl_s: int = 3,
        publish_interval_s: float = 0.25,
        credentials: EtcdCredentials | None = None,
        startup_check: Callable[[WorkerInfo, list[WorkerInfo]], None] | None = None,
    ) -> None:
        """`startup_check(own, registered)`: run once, at the first registration, on the
        workers already registered; it raises RegistrationRefused to refuse the start."""
        self.startup_check = startup_check
        self.endpoint = endpoint
        self.credentials = credentials
        self.cluster = cluster
        self.info = info
        self.ttl_s = ttl_s
        self.publish_interval_s = publish_interval_s
        # aetcd's Client and Lease (untyped), None while not registered.
        self._client: Any = None
        self._lease: Any = None
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one put / delete sequence at a time
        self._retired: set[bytes] = set()  # keys of earlier roles, deleted with every publish
        self.registered = asyncio.Event()

    async def start(self, timeout_s: float = 10.0) -> None:
        """First registration, tried again (with backoff) until it succeeds or `timeout_s`
        has passed: one etcd call that times out on a loaded machine (a just-started etcd,
        a slow lease grant) is not a failed start. Raises EtcdUnavailable with the last error
        when etcd could not be reached in time, and the startup check's RegistrationRefused
        at once (nothing registered)."""
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(first_s=0.1, max_s=1.0)
        while True:
            try:
                await asyncio.wait_for(self._register(check=True), deadline - time.monotonic())
                break
            except RegistrationRefused:
                await self._drop_client()
                raise
            except Exception as exc:
                await self._drop_client()
                if time.monotonic() + backoff.delay_s >= deadline:
                    raise EtcdUnavailable(
                        f"cannot register with etcd at {self.endpoint}: {exc!r}"
                    ) from exc
                log.warning(
                    "registering with etcd at %s failed (%r); trying again", self.endpoint, exc
                )
                await backoff.sleep()
        self._task = asyncio.create_task(self._keep_alive())

    async def _register(self, check: bool = False) -> None:
        self._client = make_client(self.endpoint, self.credentials)
        await self._client.connect()
        if check and self.startup_check is not None:
            self.startup_check(self.info(), await list_workers(self._client, self.cluster))
        self._lease = await self._client.lease(self.ttl_s)
        await self._publish()
        self.registered.set()

    async def _publish(self) -> None:
        async with self._lock:
            info = replace(self.info(), updated_at=time.time())
            key = worker_key(self.cluster, info.role, info.worker_id)
            await self._client.put(key, info.to_json(), lease=self._lease)
            self._retired.discard(key)  # switched back before the old key was deleted
            for old in list(self._retired):
                await self._client.delete(old)
                self._retired.discard(old)

    async def move(self, old_role: str) -> None:
        """After a role change (`info().role` is the new one): put the new key, then delete
        the old role's key, on the same lease — in that order, so that a watcher never sees
        the worker absent. A delete that fails is retried with every publication (until
        then the old key, on a live lease, still names the worker)."""
        info = self.info()
        old = worker_key(self.cluster, old_role, info.worker_id)
        if old != worker_key(self.cluster, info.role, info.worker_id):
            # Under the lock: a publication already in flight read the old role before the
            # switch and re-puts the old key; retiring it only after that publication ends
            # keeps it from taking the retirement back as a "switch back".
            async with self._lock:
                self._retired.add(old)
            await self.publish_now()

    async def _keep_alive(self) -> None:
        await reconnect_forever(
            self._session, f"etcd registration at {self.endpoint}", log, after_failure=self._lost
        )

    async def _session(self) -> None:
        """Publish every interval (refreshing the lease in time) until etcd fails; registers
        afresh first when the last session lost etcd."""
        if self._client is None:
            await self._register()
            log.info("re-registered with etcd at %s", self.endpoint)
        last_refresh = time.monotonic()
        while True:
            await asyncio.sleep(self.publish_interval_s)
            if time.monotonic() - last_refresh > self.ttl_s / 3:
                await self._lease.refresh()
                last_refresh = time.monotonic()
            await self._publish()

    async def _lost(self) -> None:
        """etcd went away: keep serving, drop the client; the next session re-registers."""
        self.registered.clear()
        await self._drop_client()

    async def publish_now(self) -> None:
        """Publish immediately (e.g. the draining flag flipped)."""
        if self._client is not None:
            try:
                await self._publish()
            except Exception as exc:
                log.warning("publish failed: %r", exc)

    async def deregister(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._client is not None:
            try:
                info = self.info()
                await self._client.delete(worker_key(self.cluster, info.role, info.worker_id))
                await self._lease.revoke()
            except Exception as exc:
                log.warning("deregistration incomplete: %r", exc)
        await self._drop_client()

    async def _drop_client(self) -> None:
        client, self._client, self._lease = self._client, None, None
        if client is not None:
            try:
                await client.close()
            except Exception:
                pass
