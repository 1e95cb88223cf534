"""Workers on one host lend each other idle cores (worker_runtime/host_cores.py): real peer
processes, each with its own entry in a shared directory; the engine loop marks a worker busy
only while it steps."""

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from engine.engine_loop import EngineLoop
from worker_runtime import host_cores
from worker_runtime.host_cores import HostCoreShare

pytestmark = pytest.mark.timeout(60)

PEER = """
import sys
from pathlib import Path
from worker_runtime import host_cores
from worker_runtime.host_cores import HostCoreShare
host_cores.LENT_WAIT_S = 30.0  # waits only end when this test's worker steps
share = HostCoreShare(int(sys.argv[2]), cores=4, directory=Path(sys.argv[1]), set_threads=print)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "busy":
        share.begin_step()
    elif line.strip() == "idle":
        share.end_busy()
    elif line.strip() == "exit-unclean":
        import os; os._exit(0)  # leaves its file behind, as a killed worker does
    print("ok", flush=True)
share.close()
"""


class Peer:
    """Another worker's entry: a process that holds a HostCoreShare and flips its busy flag."""

    def __init__(self, directory, share: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, str(directory), str(share)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        line = self.proc.stdout.readline().strip()
        return self._line() if line.isdigit() else line  # skip its set_threads prints

    def say(self, what: str) -> None:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        if what != "exit-unclean":
            assert self._line() == "ok"

    def later(self, what: str) -> threading.Thread:
        """`say` on a thread of its own (the peer may wait for this test's worker)."""
        thread = threading.Thread(target=self.say, args=(what,))
        thread.start()
        time.sleep(0.05)
        return thread

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def peers(tmp_path, monkeypatch):
    monkeypatch.setattr(host_cores, "REFRESH_S", 0.0)  # see new peers at every step
    started: list[Peer] = []

    def start(share: int) -> Peer:
        started.append(Peer(tmp_path, share))
        return started[-1]

    yield start
    for peer in started:
        peer.stop()


def make_share(tmp_path, share: int, applied: list[int]) -> HostCoreShare:
    return HostCoreShare(share, cores=4, directory=tmp_path, set_threads=applied.append)


def test_a_worker_uses_the_shares_of_idle_workers_and_only_those(tmp_path, peers):
    applied: list[int] = []
    me = make_share(tmp_path, 1, applied)
    try:
        assert me.begin_step() == 4  # alone on the host
        prefill, other = peers(2), peers(1)
        assert me.begin_step() == 4  # both idle
        waiting = prefill.later("busy")  # its share is in this worker's step: it waits
        assert me.begin_step() == 2  # 4 cores - the busy peer's 2
        waiting.join(10)
        waiting = other.later("busy")
        assert me.begin_step() == 1  # 4 - 3 busy elsewhere: its own share
        waiting.join(10)
        assert sorted(threads_of(tmp_path, exclude=os.getpid())) == [1, 2]
        prefill.say("idle")
        assert me.begin_step() == 3
        other.say("idle")
        assert me.begin_step() == 4
        assert applied == [4, 2, 1, 3, 4]  # applied on a change only
    finally:
        me.close()
    assert str(os.getpid()) not in {p.name for p in tmp_path.iterdir()}  # close removed its file


def test_a_lent_share_comes_back_at_the_borrowers_next_step(tmp_path, peers, monkeypatch):
    """A worker that finds its share borrowed waits until the borrower begins its next step,
    which then leaves the share: never more threads than cores."""
    monkeypatch.setattr(host_cores, "LENT_WAIT_S", 30.0)  # only the borrower's step ends the wait
    me = make_share(tmp_path, 2, [])
    view = make_share_in_peer_view(tmp_path)
    try:
        decode = peers(2)
        decode.say("busy")  # this worker is idle: the peer borrows its 2 cores
        assert view() == 2 and threads_of(tmp_path, exclude=os.getpid()) == [4]
        got: list[int] = []
        waiting = threading.Thread(target=lambda: got.append(me.begin_step()))
        waiting.start()
        time.sleep(0.05)
        assert not got  # still waiting: the peer holds all 4 cores
        decode.say("busy")  # its next step sees this worker busy and gives the 2 back
        waiting.join(10)
        assert got == [2] and threads_of(tmp_path, exclude=os.getpid()) == [2]
        assert not me.stalled_peers
    finally:
        me.close()


def test_a_borrower_that_stops_stepping_is_waited_for_once(tmp_path, peers, monkeypatch):
    monkeypatch.setattr(host_cores, "LENT_WAIT_S", 0.05)
    me = make_share(tmp_path, 2, [])
    try:
        stalled = peers(2)
        stalled.say("busy")  # borrows 4, then never steps again (a stalled process)
        assert me.begin_step() == 2  # gave up after LENT_WAIT_S: its own share
        slept: list[float] = []
        monkeypatch.setattr(host_cores.time, "sleep", slept.append)
        assert me.begin_step() == 2 and not slept  # not waited for again
        stalled.say("busy")  # it steps: counted as it is again (its share, this worker busy)
        assert me.begin_step() == 2 and not me.stalled_peers
    finally:
        me.close()


def threads_of(directory, exclude: int) -> list[int]:
    """The `threads` field of every entry but `exclude`'s."""
    return [
        host_cores._RECORD.unpack(p.read_bytes()[: host_cores._RECORD.size])[2]
        for p in directory.iterdir()
        if p.name != str(exclude)
    ]


def test_never_fewer_than_its_own_share(tmp_path, peers):
    me = make_share(tmp_path, 2, [])
    try:
        peers(3).say("busy")
        assert me.begin_step() == 2
    finally:
        me.close()


def make_share_in_peer_view(tmp_path):
    """What a peer process sees of this process's busy flag (its file, read directly)."""

    def busy_shares() -> int:
        total = 0
        for path in tmp_path.iterdir():
            share, busy, *_ = host_cores._RECORD.unpack(
                path.read_bytes()[: host_cores._RECORD.size]
            )
            total += share if busy else 0
        return total

    return busy_shares


def test_busy_flag_follows_begin_step_and_end_busy(tmp_path):
    me = make_share(tmp_path, 1, [])
    view = make_share_in_peer_view(tmp_path)
    try:
        assert view() == 0
        me.begin_step()
        assert view() == 1
        me.end_busy()
        assert view() == 0
    finally:
        me.close()
    assert not any(tmp_path.iterdir())  # close removes its file


def test_a_gone_workers_file_is_removed_and_its_share_freed(tmp_path, peers):
    me = make_share(tmp_path, 1, [])
    try:
        crashed = peers(2)
        crashed.say("busy")
        assert me.begin_step() == 2
        crashed.say("exit-unclean")  # its file stays, flagged busy
        crashed.proc.wait(10)
        assert len(list(tmp_path.iterdir())) == 2
        assert me.begin_step() == 4
        assert [p.name for p in tmp_path.iterdir()] == [str(os.getpid())]
    finally:
        me.close()


class ScriptedEngine:
    """Has work while `work` is set; records each step."""

    def __init__(self) -> None:
        self.work, self.stepped = threading.Event(), threading.Event()
        self.scheduler = SimpleNamespace(stats=SimpleNamespace(prompt_tokens=0), running=[])

    def has_schedulable_work(self) -> bool:
        return self.work.is_set()

    def step(self, inputs=None):
        self.stepped.set()
        time.sleep(0.001)
        return []


class RecordingThreads:
    def __init__(self) -> None:
        self.events: list[str] = []

    def begin_step(self) -> int:
        if not self.events or self.events[-1] != "busy":
            self.events.append("busy")
        return 1

    def end_busy(self) -> None:
        if self.events and self.events[-1] != "idle":
            self.events.append("idle")


def test_the_engine_loop_is_busy_only_while_it_steps():
    engine, threads = ScriptedEngine(), RecordingThreads()
    loop = EngineLoop(engine, lambda deltas: None, step_threads=threads)
    loop.start()
    try:
        loop.call(lambda e: None).result(5)
        assert threads.events == []  # never stepped: never busy
        engine.work.set()
        loop.call(lambda e: None).result(5)
        assert engine.stepped.wait(5)
        assert threads.events == ["busy"]
        engine.work.clear()
        deadline = time.monotonic() + 5
        while threads.events[-1] != "idle" and time.monotonic() < deadline:
            loop.call(lambda e: None).result(5)
        assert threads.events == ["busy", "idle"]
    finally:
        loop.stop()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_torch_work_off_the_loop_ends_the_openmp_team_it_started():
    """A pool thread that runs a parallel torch op keeps an OpenMP team of its own (threads
    that outlive the op); `off_the_loop` ends it, so the engine thread's team is the process's
    only one again."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import torch

    x = torch.ones(1 << 22)
    parallel_op = lambda: torch.add(x, 1)  # noqa: E731  large enough for ATen's parallel_for

    async def threads_after(run) -> int:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1))
        await run()
        return _threads()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # whatever an earlier test left: a team of two, one more thread
    try:
        before = _threads()
        kept = asyncio.run(threads_after(lambda: asyncio.to_thread(parallel_op)))
        assert kept > before + 1  # the pool thread itself (gone with its loop) and its team
        assert (
            asyncio.run(threads_after(lambda: host_cores.off_the_loop(parallel_op))) == before + 1
        )
    finally:
        torch.set_num_threads(threads)
