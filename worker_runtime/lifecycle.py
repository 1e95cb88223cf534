"""The weights lifecycle of one worker (vLLM's dev-mode calls, fanned out by the router):
sleep / wake up, prefix-cache reset, weight updates, collective_rpc.

Life cycle of a Sleep here: GOING_TO_SLEEP (new requests are refused with UNAVAILABLE from
now on; admission.py) -> drain (wait, bounded by --drain-timeout, until this worker's
in-flight calls ended and the engine has no request left; or abort them with abort = true)
-> on the engine thread: deregister the KV pool from the transfer agent, then
`engine.sleep(level)` frees it -> SLEEPING, republished -> answer. The worker refuses
requests until WakeUp, which, also on the engine thread, reallocates the pool (a new
address), registers it again (new metadata) and republishes it; once nothing sleeps any more,
the worker is SERVING again. A drain that does not end in time goes back to SERVING and fails
the call (DEADLINE_EXCEEDED); nothing sleeps. A Sleep while asleep (a deeper level) needs
no drain: nothing was admitted.

UpdateWeights drains the same way (UPDATING_WEIGHTS), then `engine.update_weights(path)`
bumps the weights version (part of every block hash, and of the registration: the router
hashes prompts with it and pairs only workers of one version) and resets the prefix cache.
While asleep it runs at once and the worker stays asleep (vLLM's sleep -> update -> wake).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

from worker_runtime.admission import Admission, WorkerPhase
from worker_runtime.contexts import EngineCall
from worker_runtime.grpc_errors import FailedPrecondition, NotFound
from worker_runtime.paths import AllowedPaths

if TYPE_CHECKING:  # annotations only: the engine (torch) is the runtime's to import
    from engine.llm_engine import LLMEngine

_ENGINE_POLL_S = 0.02  # after the calls ended: how often to ask whether the engine emptied


class KVPool(Protocol):
    """The engine's KV pool as the transfer agent knows it (pool.py `PoolRegistration`);
    `register` and `deregister` run on the engine thread."""

    @property
    def registered(self) -> bool: ...

    def register(self, engine: LLMEngine) -> None: ...

    def deregister(self) -> None: ...


class WorkerLifecycle:
    """One per worker; the asyncio side. Calls are serialized by `admission.changing`."""

    def __init__(
        self,
        admission: Admission,
        call: EngineCall,
        pool: KVPool,
        publish: Callable[[], Awaitable[None]],
        abort_all: Callable[[], Awaitable[None]],
        paths: AllowedPaths,
        *,
        sleep_mode: bool,
        drain_timeout_s: float,
    ) -> None:
        self._admission = admission
        self._call = call
        self._pool = pool
        self._publish = publish
        self._abort_all = abort_all
        self._paths = paths
        self._sleep_mode = sleep_mode
        self._drain_timeout_s = drain_timeout_s
        self.weights_version = 0
        """The engine's weights version (published; the router hashes prompts with it)."""

    @property
    def sleeping(self) -> bool:
        """The engine sleeps (published in the registration; requests are refused)."""
        return self._admission.phase is WorkerPhase.SLEEPING

    async def sleep(self, level: int, abort: bool) -> None:
        if not self._sleep_mode:
            raise FailedPrecondition("sleep needs --enable-sleep-mode on the worker")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        pool = self._pool

        def go(e: LLMEngine) -> None:
            if e.has_unfinished_requests():
                raise TimeoutError("sleep: requests are still running after the drain")
            if pool.registered:
                pool.deregister()  # before the pool's memory is freed
            e.sleep(level)

        async with self._admission.changing:
            if self.sleeping:  # deeper: nothing admitted, nothing to drain
                await self._call(go, cancellable=False)
                return
            async with self._drained(WorkerPhase.GOING_TO_SLEEP, abort):
                await self._call(go, cancellable=False)
                self._admission.move(WorkerPhase.SLEEPING)
        await self._publish()

    async def wake_up(self, tags: list[str] | None) -> None:
        pool = self._pool

        def go(e: LLMEngine) -> bool:
            e.wake_up(tags or None)
            if "kv_cache" not in e.lifecycle.asleep and not pool.registered:
                pool.register(e)  # the pool's new address: new metadata
            return e.is_sleeping()

        async with self._admission.changing:
            self._refuse_when_shutting_down()
            still_asleep = await self._call(go, cancellable=False)
            if not still_asleep:
                self._admission.leave(WorkerPhase.SLEEPING)
        await self._publish()

    async def reset_prefix_cache(self) -> None:
        await self._call(lambda e: e.reset_prefix_cache(), cancellable=False)

    async def update_weights(self, path: str) -> None:
        if not path:
            raise ValueError("path must not be empty")
        self._paths.check(path, "weights")  # before anything at the path is looked at
        if not os.path.exists(path):
            raise NotFound(f"no weights at {path}")

        def go(e: LLMEngine) -> int:
            e.update_weights(path)
            return e.weights_version

        async with self._admission.changing:
            if self.sleeping:
                self.weights_version = await self._call(go, cancellable=False)
            else:
                async with self._drained(WorkerPhase.UPDATING_WEIGHTS, abort=False):
                    self.weights_version = await self._call(go, cancellable=False)
        await self._publish()

    async def collective_rpc(self, method: str, args_json: str, kwargs_json: str) -> str:
        """Call a method of the worker extension (--worker-extension-cls) on the engine
        thread. Only the extension's public methods: the engine's own (sleep, update_weights,
        ...) change state behind the worker's back — their RPCs above drain first."""
        args = json.loads(args_json) if args_json else []
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ValueError("args must be a JSON array and kwargs a JSON object")

        def go(e: LLMEngine) -> list:
            if method.startswith("_") or not callable(getattr(e.extension, method, None)):
                raise ValueError(
                    f"collective_rpc: {method!r} is not a method of the worker "
                    "extension (--worker-extension-cls); over the network "
                    "collective_rpc calls only those"
                )
            return e.collective_rpc(method, tuple(args), kwargs)

        results = await self._call(go, cancellable=False)
        return json.dumps(results, default=repr)

    # ---- draining -------------------------------------------------------------------------
    def _refuse_when_shutting_down(self) -> None:
        if self._admission.phase is WorkerPhase.SHUTTING_DOWN:
            raise FailedPrecondition("worker is shutting down")

    @asynccontextmanager
    async def _drained(self, phase: WorkerPhase, abort: bool) -> AsyncIterator[None]:
        """Enter `phase` (new calls are refused), then wait until nothing runs — no call in
        flight and no request in the engine — aborting what runs with `abort`; bounded by
        --drain-timeout. The body ends the phase; a failure anywhere goes back to SERVING."""
        self._refuse_when_shutting_down()
        admission = self._admission
        admission.move(phase)
        try:
            if abort:
                await self._abort_all()
            deadline = time.monotonic() + self._drain_timeout_s
            while not (
                await admission.wait_idle(deadline - time.monotonic())
                and not await self._call(lambda e: e.has_unfinished_requests())
            ):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{phase.value}: {admission.inflight} requests still in "
                        f"flight after {self._drain_timeout_s:g} s (abort=true "
                        "aborts them)"
                    )
                await asyncio.sleep(_ENGINE_POLL_S)
            yield
        finally:
            admission.leave(phase)
