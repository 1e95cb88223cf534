"""The weights lifecycle of one worker (vLLM's dev-mode calls, fanned out by the router):
sleep / wake up, prefix-cache reset, weight updates, collective_rpc.

Life cycle of a Sleep here: pause (new requests are refused with UNAVAILABLE from now on)
-> drain (wait, bounded by --drain-timeout, until this worker's in-flight requests finished;
or abort them with abort = true) -> on the engine thread: deregister the KV pool from the
transfer agent, then `engine.sleep(level)` frees it -> republish (sleeping) -> answer. The
worker keeps refusing requests until WakeUp, which, also on the engine thread, reallocates
the pool (a new address), registers it again (new metadata) and republishes it. A drain
that does not finish in time un-pauses and fails the call (DEADLINE_EXCEEDED); nothing sleeps.

UpdateWeights pauses and drains the same way, then `engine.update_weights(path)` bumps the
weights version (part of every block hash, and of the registration: the router hashes
prompts with it and pairs only workers of one version) and resets the prefix cache.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import TYPE_CHECKING, Any

from worker_runtime.grpc_errors import FailedPrecondition, NotFound

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from worker_runtime.runtime import WorkerRuntime


class WorkerLifecycle:
    """One per worker; the asyncio side. Calls are serialized (`lock`)."""

    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        self.sleeping = False
        """The engine sleeps (published in the registration; requests are refused)."""
        self.weights_version = 0
        """The engine's weights version (published; the router hashes prompts with it)."""
        self.lock = asyncio.Lock()
        """Held through every change of the worker's state: sleep, wake-up, weight update,
        and role switch (roles.py), so they never interleave."""

    async def sleep(self, level: int, abort: bool) -> None:
        rt = self.rt
        if not rt.engine.config.enable_sleep_mode:
            raise FailedPrecondition("sleep needs --enable-sleep-mode on the worker")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        async with self.lock, self._paused("going to sleep", abort):
            def go(e: LLMEngine) -> None:
                if e.has_unfinished_requests():
                    raise TimeoutError("sleep: requests are still running after the drain")
                rt.deregister_pool()  # before the pool's memory is freed
                e.sleep(level)

            await rt.call(go, cancellable=False)
            self.sleeping = True
        await rt.republish()

    async def wake_up(self, tags: list[str] | None) -> None:
        rt = self.rt
        async with self.lock:
            def go(e: LLMEngine) -> bool:
                e.wake_up(tags or None)
                if "kv_cache" not in e.lifecycle.asleep and not rt.kv_pool_registered:
                    rt.register_pool()  # the pool's new address: new metadata
                return e.is_sleeping()

            self.sleeping = await rt.call(go, cancellable=False)
        await rt.republish()

    async def reset_prefix_cache(self) -> None:
        await self.rt.call(lambda e: e.reset_prefix_cache(), cancellable=False)

    async def update_weights(self, path: str) -> None:
        if not path:
            raise ValueError("path must not be empty")
        if not os.path.exists(path):
            raise NotFound(f"no weights at {path}")
        rt = self.rt
        async with self.lock, self._paused("updating weights", abort=False):
            def go(e: LLMEngine) -> int:
                e.update_weights(path)
                return e.weights_version

            self.weights_version = await rt.call(go, cancellable=False)
        await rt.republish()

    async def collective_rpc(self, method: str, args_json: str, kwargs_json: str) -> str:
        args = json.loads(args_json) if args_json else []
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ValueError("args must be a JSON array and kwargs a JSON object")
        results = await self.rt.call(lambda e: e.collective_rpc(method, tuple(args), kwargs),
                                     cancellable=False)
        return json.dumps(results, default=repr)

    # ---- pausing --------------------------------------------------------------------------
    def _paused(self, why: str, abort: bool):
        return _Pause(self.rt, why, abort)


class _Pause:
    """Refuse new requests, then wait until the worker has none in flight (aborting them
    with `abort`); un-pause on the way out. The drain is bounded by --drain-timeout."""

    def __init__(self, rt: WorkerRuntime, why: str, abort: bool) -> None:
        self.rt, self.why, self.abort = rt, why, abort

    async def __aenter__(self) -> None:
        rt = self.rt
        rt.paused = self.why
        try:
            if self.abort:
                await abort_all(rt)
            deadline = time.monotonic() + rt.config.drain_timeout_s
            while (rt.inflight or await rt.call(lambda e: e.has_unfinished_requests())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.why}: {rt.inflight} requests still in flight "
                                       f"after {rt.config.drain_timeout_s:g} s (abort=true "
                                       "aborts them)")
                await asyncio.sleep(0.02)
        except BaseException:
            rt.paused = None
            raise

    async def __aexit__(self, *exc: Any) -> None:
        self.rt.paused = None


async def abort_all(rt: WorkerRuntime) -> None:
    """`Worker.Abort` every request this worker has: its streams and the engine's."""
    def live(e: LLMEngine) -> set[str]:
        s = e.scheduler
        return {r.group_id for r in (*s.running, *s.waiting, *s.waiting_for_kv)}

    ids = set(rt.streams) | await rt.call(live)
    await asyncio.gather(*(rt.abort(rid) for rid in ids), return_exceptions=True)
