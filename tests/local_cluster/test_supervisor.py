"""The supervisor's restart rules with fake children (no processes): backoff and crash loop,
restarts off, a crash is only an exit nobody asked for, scale-in and shutdown during a backoff
leave no child running and start none afterwards."""

import itertools
import threading
import time
from pathlib import Path

from local_cluster.config import UpConfig
from local_cluster.slots import RestartPolicy, Slot, SlotState
from local_cluster.supervisor import Supervisor

_pids = itertools.count(1000)


class FakeChild:
    def __init__(self, ready: bool = True):
        self.pid = next(_pids)
        self.code: int | None = None
        self._ready = ready
        self.terminated = threading.Event()

    def alive(self):
        return self.code is None

    def exit_code(self):
        return self.code

    def ready(self):
        return self._ready

    def terminate(self):
        self.terminated.set()
        if self.code is None:
            self.code = 0
        return self.code

    def kill(self):
        if self.code is None:
            self.code = -9


class Spawner:
    """Records every child it started; `fail` children exit at once with code 2."""

    def __init__(self, fail: bool = False):
        self.children: list[FakeChild] = []
        self.fail = fail

    def __call__(self):
        child = FakeChild()
        if self.fail:
            child.code = 2
        self.children.append(child)
        return child


def make_supervisor(**policy) -> Supervisor:
    config = UpConfig(
        num_threads=1, cluster="test", restart=RestartPolicy(**{"backoff": 0.05, **policy})
    )
    return Supervisor(config, "127.0.0.1:1", Path("/nonexistent-logs"))


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_backoff_doubles_and_is_capped():
    policy = RestartPolicy(backoff=1.0, max_backoff=30.0)
    assert [policy.delay(k) for k in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 4, 8, 16, 30, 30]
    assert RestartPolicy(backoff=40.0).delay(3) == 40.0  # the cap never undercuts the first delay


def test_crashes_outside_the_window_are_forgotten():
    policy = RestartPolicy(backoff=1.0, max_restarts=2, window=10.0)
    slot = Slot("decode-1", "decode", spawn=Spawner())
    assert slot.on_crash(-9, policy, now=0.0) == 1.0
    assert slot.on_crash(-9, policy, now=1.0) == 2.0
    assert slot.on_crash(-9, policy, now=20.0) == 1.0  # the first two are older than the window
    assert slot.state is SlotState.RESTARTING
    assert slot.on_crash(-9, policy, now=21.0) == 2.0
    assert slot.on_crash(1, policy, now=22.0) is None  # third within the window: crash loop
    assert slot.state is SlotState.CRASH_LOOP and slot.last_exit == 1


def test_a_crashed_child_is_restarted_until_the_crash_loop_limit(capsys):
    sup = make_supervisor(max_restarts=3)
    spawn = Spawner()
    sup.add_slot("decode", spawn)
    sup.start()
    try:
        wait_for(lambda: sup.states("decode") == [SlotState.READY])
        for _ in range(3):
            n = len(spawn.children)
            spawn.children[-1].kill()
            wait_for(
                lambda: len(spawn.children) == n + 1 and sup.states("decode") == [SlotState.READY]
            )
        spawn.children[-1].kill()
        wait_for(lambda: sup.states("decode") == [SlotState.CRASH_LOOP])
        time.sleep(0.5)
        assert len(spawn.children) == 4  # no restart after the crash loop
        view = sup.snapshot()["slots"][0]
        assert (view["state"], view["restarts"], view["last_exit"], view["pid"]) == (
            "crash-loop",
            3,
            -9,
            None,
        )
    finally:
        sup.stop_all()
    assert "error: decode-1 (decode) crashed 4 times" in capsys.readouterr().out


def test_restarts_off_means_the_first_crash_is_final():
    sup = make_supervisor(max_restarts=0)
    spawn = Spawner()
    sup.add_slot("prefill", spawn)
    sup.start()
    try:
        wait_for(lambda: sup.states("prefill") == [SlotState.READY])
        spawn.children[0].kill()
        wait_for(lambda: sup.states("prefill") == [SlotState.CRASH_LOOP])
        assert len(spawn.children) == 1
    finally:
        sup.stop_all()


def test_scale_in_is_not_a_crash_and_removes_broken_slots_first():
    sup = make_supervisor(backoff=60.0)
    good, bad = Spawner(), Spawner(fail=True)
    sup.add_slot("decode", good)
    sup.add_slot("decode", bad)  # exits at once: waits out a 60 s backoff
    sup.add_slot("decode", good)
    sup.start()
    try:
        wait_for(
            lambda: (
                sorted(sup.states("decode"))
                == [SlotState.READY, SlotState.READY, SlotState.RESTARTING]
            )
        )
        sup.scale("decode", -1)  # the restarting slot goes first, without starting anything
        wait_for(lambda: sup.states("decode") == [SlotState.READY, SlotState.READY])
        assert len(bad.children) == 1
        sup.scale("decode", -1)  # then the newest ready one: drained, not restarted
        wait_for(lambda: len(sup.states("decode")) == 1)
        assert good.children[1].terminated.is_set() and not good.children[0].terminated.is_set()
        time.sleep(0.5)
        assert len(good.children) == 2
    finally:
        sup.stop_all()


def test_stop_during_a_backoff_stops_every_child_and_starts_none():
    sup = make_supervisor(backoff=0.3)
    spawns = [Spawner() for _ in range(4)]
    for i, spawn in enumerate(spawns):
        sup.add_slot("etcd" if i == 0 else "decode", spawn)
    sup.start()
    wait_for(lambda: all(s.children for s in spawns))
    spawns[1].children[0].kill()
    wait_for(lambda: SlotState.RESTARTING in sup.states("decode"))
    sup.stop_all()
    started = [c for s in spawns for c in s.children]
    time.sleep(0.6)  # past the backoff: nothing is started after stop_all
    assert [c for s in spawns for c in s.children] == started
    assert not [c for c in started if c.alive()]
    assert sup.snapshot()["slots"] == []
