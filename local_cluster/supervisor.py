"""The child processes of one `pdserve up`, kept alive: each worker, the router and etcd (when
`up` started it) lives in a slot (slots.py), and one monitor thread starts, watches and restarts
them. The control server's threads call `scale` and `snapshot`; `stop_all` runs once, at the end.

Invariants: only the monitor thread spawns children, and `stop_all` joins it before stopping
them, so every child ever started is stopped at shutdown (by PID). A slot's state and child are
changed only under `lock`; a child that exits while its slot is DRAINING was asked to stop, any
other exit is a crash.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from cluster.etcd_security import EtcdSecurity
from cluster.roles import ROLES, Role
from engine.flags import to_argv
from local_cluster.config import UpConfig
from local_cluster.launcher import ServiceProcess
from local_cluster.slots import Child, Slot, SlotState
from worker_runtime.args import WorkerConfig

if TYPE_CHECKING:
    from cluster.registration import WorkerInfo


class PlannerView(Protocol):
    """What the supervisor and its control server show of `up --planner`'s planner
    (local_cluster/planner_loop.py)."""

    def view(self) -> dict: ...

    def metrics_text(self) -> bytes: ...

    def stop(self) -> None: ...


TICK_S = 0.2


class Supervisor:
    def __init__(
        self,
        config: UpConfig,
        etcd_endpoint: str,
        log_dir: Path,
        worker_etcd: EtcdSecurity = EtcdSecurity(),
        router_etcd: EtcdSecurity = EtcdSecurity(),
    ) -> None:
        """`worker_etcd` / `router_etcd`: the etcd flags of the workers (a user that may write
        the cluster's keys) and of the router, the planner and `status` (one that may read
        them)."""
        self.config = config
        self.etcd = etcd_endpoint
        self.worker_etcd = worker_etcd
        self.router_etcd = router_etcd
        self.log_dir = log_dir
        self.policy = config.restart
        self.slots: list[Slot] = []
        self.lock = threading.Lock()
        self._serial = 0
        self._halt = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="supervisor", daemon=True)
        self.planner: PlannerView | None = None
        """`up --planner`'s planner, shown by `snapshot` (it calls set_worker_role)."""

    # -- slots ------------------------------------------------------------------------------

    def add_slot(self, role: str, spawn: Callable[[], Child] | None = None, name: str = "") -> Slot:
        """A new slot, started by the monitor on its next tick (slots start in the order added).
        A worker slot starts its child in the slot's role at the time (see set_worker_role)."""
        with self.lock:
            if not name:
                self._serial += 1
                name = f"{role}-{self._serial}"
            slot = Slot(
                name, role, spawn or (lambda: self._spawn_worker(Role(slot.role), slot.name))
            )
            self.slots.append(slot)
        return slot

    def _spawn_worker(self, role: Role, name: str) -> ServiceProcess:
        return ServiceProcess(self.worker_command(role), self.log_dir / f"{name}.log")

    def worker_command(self, role: Role) -> list[str]:
        """`pdserve <role> ...`'s arguments: the worker's WorkerConfig (this cluster's etcd and
        the workers' etcd user, name, thread count, gRPC security and the directories it may
        load weights and adapters from: `UpConfig.model_roots`) and
        `UpConfig.engine_for(role)` as flags (engine.flags.to_argv: every field off its
        default), then --worker-arg's, then --prefill-arg's or --decode-arg's (a later flag
        wins)."""
        c = self.config
        worker = WorkerConfig(
            role=role,
            etcd=self.etcd,
            etcd_security=self.worker_etcd,
            cluster=c.cluster,
            num_threads=self._threads(),
            enable_admin_rpcs=c.runs_admin_rpcs,
            allowed_model_paths=c.model_roots,
            grpc_security=c.grpc_security,
        )
        return [
            role,
            *to_argv(worker),
            *to_argv(c.engine_for(role)),
            *c.worker_args,
            *c.role_args(role),
        ]

    def _threads(self) -> int:
        if self.config.num_threads:
            return self.config.num_threads
        with self.lock:
            total = len([s for s in self.slots if s.role in ROLES and not s.state.stopping])
        return max(1, (os.cpu_count() or 2) // max(1, total))

    def slot_of(self, grpc_address: str) -> str | None:
        """The name of the worker slot whose current child serves at `grpc_address`."""
        with self.lock:
            slot = self._worker_slot(grpc_address)
            return slot.name if slot is not None else None

    def set_worker_role(self, grpc_address: str, role: str) -> None:
        """The worker at `grpc_address` switched to `role` in place (Worker.SetRole): its slot
        takes that role, so a crash restarts it as `pdserve <role>` — the role it had when it
        died. The slot keeps its name (and log file)."""
        with self.lock:
            slot = self._worker_slot(grpc_address)
            if slot is not None and slot.role != role:
                slot.role = role

    def follow_registrations(self, workers: Iterable[WorkerInfo]) -> None:
        """Slots take the role their worker is registered under (a switch made by anyone)."""
        for w in workers:
            if not w.draining:
                self.set_worker_role(w.grpc_address, w.role)

    def _worker_slot(self, grpc_address: str) -> Slot | None:
        for slot in self.slots:
            if (
                slot.role in ROLES
                and slot.child is not None
                and grpc_address
                and getattr(slot.child, "grpc_address", "") == grpc_address
            ):
                return slot
        return None

    def settling(self) -> bool:
        """A worker slot is starting or waiting out a restart backoff (the pools are about to
        change; a crashed worker's registration may outlive it for a lease TTL)."""
        with self.lock:
            return any(
                s.role in ROLES and s.state in (SlotState.STARTING, SlotState.RESTARTING)
                for s in self.slots
            )

    def states(self, role: str) -> list[SlotState]:
        with self.lock:
            return [s.state for s in self.slots if s.role == role]

    def say(self, msg: str) -> None:
        """A line on stdout. A closed stdout (the terminal or the process reading it gone)
        never stops the cluster's work: a failed write here once left every child running
        after `up` exited."""
        try:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
        except OSError:
            pass

    # -- the monitor ------------------------------------------------------------------------

    def start(self) -> None:
        self._monitor.start()

    def _monitor_loop(self) -> None:
        while not self._halt.is_set():
            with self.lock:
                slots = list(self.slots)
            for slot in slots:
                if self._halt.is_set():
                    return
                try:
                    self._step(slot, time.monotonic())
                except Exception as exc:  # never let one slot stop the supervision of all
                    self.say(f"error: supervising {slot.name}: {exc!r}")
            self._halt.wait(TICK_S)

    def _step(self, slot: Slot, now: float) -> None:
        with self.lock:
            state, child = slot.state, slot.child
            if state is SlotState.RESTARTING and now >= slot.restart_at:
                state, slot.state = SlotState.STARTING, SlotState.STARTING
                slot.restarts += 1
        if state is SlotState.STARTING and child is None:
            self._start(slot)
        elif state is SlotState.DRAINING:
            if child is None or not child.alive():
                with self.lock:
                    slot.state = SlotState.STOPPED
                    self.slots.remove(slot)
        elif child is None:
            return
        elif not child.alive():
            self._on_crash(slot, child, child.exit_code())
        elif state is SlotState.STARTING and child.ready():
            with self.lock:
                if slot.state is SlotState.STARTING and slot.child is child:
                    slot.state = SlotState.READY
            back = (
                f" (restored {now - slot.crashed_at:.1f}s after the crash)" if slot.restarts else ""
            )
            self.say(f"{slot.name} is ready, pid {child.pid}{back}")
        elif state is SlotState.STARTING and now - slot.started_at > self.policy.startup_timeout:
            self.say(f"{slot.name} not ready within {self.policy.startup_timeout:.0f}s; killing it")
            child.kill()  # the next tick sees the exit: a crash

    def _start(self, slot: Slot) -> None:
        try:
            child = slot.spawn()
        except Exception as exc:  # e.g. etcd that does not come up: a crash like any other
            self.say(f"{slot.name} failed to start: {exc}")
            self._on_crash(slot, None, None)
            return
        with self.lock:
            slot.child, slot.started_at = child, time.monotonic()
            removed = slot.state.stopping  # scaled in while it was being spawned
        if removed:
            threading.Thread(target=child.terminate, daemon=True).start()

    def _on_crash(self, slot: Slot, child: Child | None, code: int | None) -> None:
        with self.lock:
            if slot.state.stopping or slot.child is not child:
                return  # asked to stop meanwhile: not a crash
            delay = slot.on_crash(code, self.policy, time.monotonic())
            recent = len(slot.crashes)
        log = self.log_dir / f"{slot.name}.log"
        if delay is None:
            self.say(
                f"error: {slot.name} ({slot.role}) crashed {recent} times within "
                f"{self.policy.window:.0f}s (last exit code {code}): crash loop, not restarting "
                f"it; see {log}"
            )
        else:
            self.say(
                f"{slot.name} ({slot.role}) exited with code {code}; restarting it in "
                f"{delay:.1f}s (crash {recent} within {self.policy.window:.0f}s)"
            )

    # -- control port -----------------------------------------------------------------------

    def scale(self, role: str, delta: int) -> dict:
        """+K: K new slots, waited for until ready or in a crash loop; -K: drain and stop K
        slots of `role` (broken ones first, then the newest ready ones)."""
        if role not in ROLES:
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if delta > 0:
            slots = [self.add_slot(role) for _ in range(delta)]
            deadline = time.monotonic() + self.policy.startup_timeout + 5
            while time.monotonic() < deadline and any(
                s.state not in (SlotState.READY, SlotState.CRASH_LOOP, SlotState.STOPPED)
                for s in slots
            ):
                time.sleep(TICK_S)
        else:
            with self.lock:
                live = [s for s in self.slots if s.role == role and not s.state.stopping]
                order = [s for s in reversed(live) if s.state is not SlotState.READY] + [
                    s for s in reversed(live) if s.state is SlotState.READY
                ]
                chosen = order[:-delta]
                for slot in chosen:
                    slot.state = SlotState.DRAINING  # the monitor drops it once its child exited
                children = [s.child for s in chosen if s.child is not None]
            for child in children:  # drains, then exits
                threading.Thread(target=child.terminate, daemon=True).start()
        return self.snapshot()

    def snapshot(self) -> dict:
        """{"pids": live child PIDs by role, "slots": one SlotView (as a dict) per slot, and with
        --planner "planner": Planner.view()}."""
        with self.lock:
            views = [s.view() for s in self.slots]
        pids: dict[str, list[int]] = {r: [] for r in (*ROLES, "router", "etcd")}
        for v in views:
            if v.pid is not None:
                pids[v.role].append(v.pid)
        doc = {"pids": pids, "slots": [dataclasses.asdict(v) for v in views]}
        if self.planner is not None:
            doc["planner"] = self.planner.view()
        return doc

    # -- shutdown ---------------------------------------------------------------------------

    def stop_all(self) -> None:
        """Stop the monitor (no child is started after this), then every child: workers first
        (in parallel; they drain), the router, etcd last."""
        self._halt.set()
        if self._monitor.is_alive():
            self._monitor.join()
        with self.lock:
            for slot in self.slots:
                slot.state = SlotState.DRAINING
            slots = list(self.slots)
        for roles in (ROLES, ("router",), ("etcd",)):
            threads = [
                threading.Thread(target=s.child.terminate)
                for s in slots
                if s.role in roles and s.child is not None
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        with self.lock:
            for slot in slots:
                slot.state = SlotState.STOPPED
            self.slots = []
