"""The weights lifecycle (worker_runtime/lifecycle.py) over a real Admission and a fake
engine thread: a sleep drains then frees the pool, a drain that does not end goes back to
serving, sleeping deeper and updating weights while asleep need no drain, shutdown wins;
collective_rpc reaches only the worker extension's methods."""

import asyncio
from types import SimpleNamespace

import pytest

from cluster.roles import Role
from worker_runtime.admission import Admission, WorkerPhase
from worker_runtime.grpc_errors import FailedPrecondition, PermissionDenied, Unavailable
from worker_runtime.lifecycle import WorkerLifecycle
from worker_runtime.paths import AllowedPaths

pytestmark = pytest.mark.timeout(30)


class FakeEngine:
    def __init__(self) -> None:
        self.level = 0
        self.unfinished = False
        self.weights_version = 0
        self.lifecycle = SimpleNamespace(asleep=set())
        self.extension = None

    def collective_rpc(self, method, args, kwargs):
        target = self.extension if hasattr(self.extension, method) else self
        return [getattr(target, method)(*args, **kwargs)]

    def has_unfinished_requests(self) -> bool:
        return self.unfinished

    def sleep(self, level: int) -> None:
        self.level = max(self.level, level)
        self.lifecycle.asleep = {"kv_cache", "weights"}

    def wake_up(self, tags) -> None:
        self.lifecycle.asleep -= set(tags or ("kv_cache", "weights"))
        if not self.lifecycle.asleep:
            self.level = 0

    def is_sleeping(self) -> bool:
        return bool(self.lifecycle.asleep)

    def update_weights(self, path: str) -> None:
        self.weights_version += 1


class FakePool:
    def __init__(self) -> None:
        self.registered = True
        self.events: list[str] = []

    def register(self, engine) -> None:
        self.registered = True
        self.events.append("register")

    def deregister(self) -> None:
        self.registered = False
        self.events.append("deregister")


def make(drain_timeout_s: float = 5.0, roots: tuple[str, ...] = ()):
    engine, pool, admission = FakeEngine(), FakePool(), Admission("decode")
    published: list[WorkerPhase] = []

    async def call(fn, *, cancellable=True):
        return fn(engine)

    async def publish():
        published.append(admission.phase)

    async def abort_all():
        engine.unfinished = False

    life = WorkerLifecycle(
        admission,
        call,
        pool,
        publish,
        abort_all,
        AllowedPaths(roots),
        sleep_mode=True,
        drain_timeout_s=drain_timeout_s,
    )
    return SimpleNamespace(
        engine=engine, pool=pool, admission=admission, life=life, published=published
    )


def test_sleep_drains_in_flight_calls_then_frees_and_wake_up_serves_again():
    async def main():
        w = make()
        call = w.admission.admitted(Role.DECODE, "r")
        call.__enter__()
        sleeping = asyncio.create_task(w.life.sleep(1, abort=False))
        await asyncio.sleep(0.05)
        assert not sleeping.done() and w.admission.phase is WorkerPhase.GOING_TO_SLEEP
        with pytest.raises(Unavailable, match="going to sleep"):
            w.admission.check(Role.DECODE)
        call.__exit__(None, None, None)
        await sleeping
        assert w.life.sleeping and w.engine.level == 1 and w.pool.events == ["deregister"]
        assert w.published == [WorkerPhase.SLEEPING]
        await w.life.sleep(2, abort=False)  # deeper, no drain
        assert w.engine.level == 2 and w.life.sleeping
        await w.life.update_weights(__file__)  # while asleep: stays asleep
        assert w.life.weights_version == 1 and w.life.sleeping
        await w.life.wake_up(["weights"])
        assert w.life.sleeping and not w.pool.registered
        await w.life.wake_up(None)
        assert not w.life.sleeping and w.pool.events == ["deregister", "register"]
        w.admission.check(Role.DECODE)

    asyncio.run(main())


def test_a_drain_that_does_not_end_goes_back_to_serving_and_abort_ends_it():
    async def main():
        w = make(drain_timeout_s=0.1)
        w.engine.unfinished = True  # a request the engine still runs
        with pytest.raises(TimeoutError, match="abort=true aborts them"):
            await w.life.sleep(1, abort=False)
        assert w.admission.phase is WorkerPhase.SERVING and w.pool.registered
        assert w.engine.level == 0 and w.published == []
        await w.life.sleep(1, abort=True)
        assert w.life.sleeping

    asyncio.run(main())


def test_updating_weights_refuses_calls_then_serves_and_shutdown_refuses_changes():
    async def main():
        w = make()
        await w.life.update_weights(__file__)
        assert w.life.weights_version == 1 and w.admission.phase is WorkerPhase.SERVING
        w.admission.move(WorkerPhase.SHUTTING_DOWN)
        for change in (
            w.life.sleep(1, abort=False),
            w.life.update_weights(__file__),
            w.life.wake_up(None),
        ):
            with pytest.raises(FailedPrecondition, match="shutting down"):
                await change
        assert w.life.weights_version == 1 and w.engine.level == 0

    asyncio.run(main())


def test_collective_rpc_calls_only_the_worker_extension():
    class Extension:
        def num_blocks(self, scale=1):
            return 7 * scale

        def _private(self):
            raise AssertionError("reached")

    async def main():
        w = make()
        for method in ("num_blocks", "sleep", "update_weights"):  # no extension: nothing
            with pytest.raises(ValueError, match="not a method of the worker extension"):
                await w.life.collective_rpc(method, "[]", "{}")
        w.engine.extension = Extension()
        assert await w.life.collective_rpc("num_blocks", "[2]", "{}") == "[14]"
        for method in ("sleep", "_private", "__init__"):  # the engine's own, and private ones
            with pytest.raises(ValueError, match="not a method of the worker extension"):
                await w.life.collective_rpc(method, "[]", "{}")
        assert w.engine.level == 0
        with pytest.raises(ValueError, match="JSON array"):
            await w.life.collective_rpc("num_blocks", "{}", "{}")

    asyncio.run(main())


def test_weights_outside_the_allowed_paths_are_refused_alike_whether_or_not_they_exist(tmp_path):
    inside = tmp_path / "weights"
    inside.mkdir()
    (inside / "model.safetensors").write_bytes(b"")
    (tmp_path / "link").symlink_to("/etc")

    async def main():
        w = make(roots=(str(inside),))
        refusals = []
        for path in (
            "/etc/passwd",
            "/no/such/file",
            str(tmp_path / "link" / "passwd"),
            str(inside / ".." / "weights2"),
        ):
            with pytest.raises(PermissionDenied, match="outside --allowed-model-paths") as exc:
                await w.life.update_weights(path)
            refusals.append(str(exc.value).replace(path, "P"))
        assert len(set(refusals)) == 1  # the same answer: nothing learnt about the path
        await w.life.update_weights(str(inside / "model.safetensors"))
        assert w.life.weights_version == 1

    asyncio.run(main())
