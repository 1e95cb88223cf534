"""`pdserve up --planner`: a thread in the supervisor's process that moves workers between the
prefill and decode pools without restarting them.

Every `PlannerConfig.interval_s`: read the registrations from etcd and the router's and each
worker's /metrics -> measure.Window's Snapshot -> planner.decide -> on a move, `Worker.SetRole`
on the chosen worker (it drains its role, keeps its engine and prefix cache and re-registers
under the new role), then the supervisor's slot takes the new role (so a crash restarts it in
that role) and the window starts afresh. Every move, and every change in the kind of hold, is
logged in `up`'s output; moves, failures, pool sizes and loads are exported in Prometheus text
at the control port's /metrics and summarised in its GET (`pdserve status`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from cluster.etcd_security import EtcdCredentials
from cluster.grpc_security import ClusterAuth
from cluster.registration import WorkerInfo, list_workers, make_client
from cluster.roles import ROLES
from local_cluster.measure import Sample, Window
from local_cluster.metrics_text import Scrape
from local_cluster.planner import Decision, PlannerConfig, decide

if TYPE_CHECKING:
    from local_cluster.supervisor import Supervisor

RoleSwitch = Callable[[WorkerInfo, str], None]
"""Switches one worker to a role; returns once it serves the new role, raises if it could not."""


def grpc_set_role(drain_timeout_s: float, auth: ClusterAuth) -> RoleSwitch:
    """The real switch: `Worker.SetRole` over gRPC (presenting `auth`), waiting out the
    worker's drain."""

    def set_role(worker: WorkerInfo, role: str) -> None:
        from cluster.grpc_auth import channel as grpc_channel
        from proto import pdserve_pb2 as pb
        from proto import pdserve_pb2_grpc

        with grpc_channel(worker.grpc_address, auth) as channel:
            pdserve_pb2_grpc.WorkerStub(channel).SetRole(
                pb.SetRoleRequest(role=role, drain_timeout_s=drain_timeout_s),
                timeout=drain_timeout_s + 30.0,
            )

    return set_role


def etcd_workers(
    endpoint: str, cluster: str, credentials: EtcdCredentials | None = None
) -> Callable[[], list[WorkerInfo]]:
    def read() -> list[WorkerInfo]:
        async def fetch() -> list[WorkerInfo]:
            async with make_client(endpoint, credentials) as client:
                return await list_workers(client, cluster)

        return asyncio.run(fetch())

    return read


def http_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.read().decode()


@dataclass(frozen=True)
class Move:
    at: float  # unix time
    worker_id: str
    slot: str | None
    from_role: str
    to_role: str
    reason: str
    ok: bool
    error: str = ""


@dataclass
class PlannerState:
    """What the control port shows; mutated by the planner thread only."""

    last_decision: str = ""
    pools: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    loads: dict[str, float | None] = field(default_factory=dict)
    moves: deque[Move] = field(default_factory=lambda: deque(maxlen=20))
    """The latest moves (and failed attempts)."""
    move_count: int = 0
    """Moves and failed attempts since start."""


class Planner:
    def __init__(
        self,
        supervisor: Supervisor,
        router_url: str,
        config: PlannerConfig,
        switch: RoleSwitch,
        read_workers: Callable[[], list[WorkerInfo]],
        fetch: Callable[[str], str] = http_text,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sup = supervisor
        self.router_url = router_url
        self.config = config
        self.switch = switch
        self.read_workers = read_workers
        self.fetch = fetch
        self.clock = clock
        self.window = Window(config.window_s)
        self.state = PlannerState()
        self._last_move_at: float | None = None
        self._last_outcome = ""
        self._members: frozenset[tuple[str, str]] = frozenset()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="planner", daemon=True)
        self.registry = r = CollectorRegistry()
        self._moves = Counter(
            "pdserve_planner_moves",
            "Role switches the planner made",
            ["from_role", "to_role"],
            registry=r,
        )
        self._failures = Counter(
            "pdserve_planner_move_failures",
            "Role switches that failed",
            ["from_role", "to_role"],
            registry=r,
        )
        self._decisions = Counter(
            "pdserve_planner_decisions",
            "Planner rounds by outcome (a move, or why it held)",
            ["outcome"],
            registry=r,
        )
        self._pool = Gauge(
            "pdserve_planner_pool_size",
            "Workers registered per role (not draining)",
            ["role"],
            registry=r,
        )
        self._load = Gauge(
            "pdserve_planner_pool_load",
            "Modelled pool load (1 = saturated; -1 = no such pool)",
            ["pool"],
            registry=r,
        )
        for a, b in itertools.permutations(ROLES, 2):
            self._moves.labels(a, b)
            self._failures.labels(a, b)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current round (a switch in flight finishes first)."""
        self._halt.set()
        if self._thread.is_alive():
            self._thread.join()

    def metrics_text(self) -> bytes:
        return generate_latest(self.registry)

    def view(self) -> dict:
        s = self.state
        return {
            "pools": dict(s.pools),
            "loads": dict(s.loads),
            "last_decision": s.last_decision,
            "move_count": s.move_count,
            "moves": [dataclasses.asdict(m) for m in s.moves],
        }

    # -- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._halt.wait(self.config.interval_s):
            try:
                self.round()
            except Exception as exc:  # a failed scrape or etcd read: try again next round
                self._decisions.labels("error").inc()
                if self._last_outcome != "error":  # once per outage, not every round
                    self.sup.say(f"planner: round failed: {exc!r}")
                self._last_outcome = "error"

    def round(self) -> Decision | None:
        """One measurement + decision (+ move). None without a decision: the window does not
        cover the config's `window_s` yet, or a worker slot is starting or restarting."""
        workers = self.read_workers()
        self.sup.follow_registrations(workers)
        active = [w for w in workers if not w.draining]
        members = frozenset((w.worker_id, w.role) for w in active)
        if members != self._members:  # other pools: earlier measurements do not describe them
            self.window.clear()
            self._members = members
        self.window.add(self._sample(workers))
        self.state.pools = {role: sum(w.role == role for w in active) for role in ROLES}
        for role, n in self.state.pools.items():
            self._pool.labels(role).set(n)
        if self.sup.settling():  # a crashed worker comes back, or a scale-out starts one
            self._note_hold("settling", "a worker is starting or restarting")
            return None
        snap = self.window.snapshot(workers, self.config.quantile)
        if snap is None:
            return None
        now = self.clock()
        since = None if self._last_move_at is None else now - self._last_move_at
        decision = decide(snap, self.config, since)
        self.state.loads = {"prefill": decision.loads.prefill, "decode": decision.loads.decode}
        for pool, load in self.state.loads.items():
            self._load.labels(pool).set(-1 if load is None else load)
        if decision.is_move:
            self._move(decision, {w.worker_id: w for w in workers}[decision.worker_id or ""])
            self._last_outcome = decision.outcome
            self.state.last_decision = decision.reason
        else:
            self._note_hold(decision.outcome, decision.reason)
        return decision

    def _note_hold(self, outcome: str, reason: str) -> None:
        """Count a hold; log it when its kind changes."""
        self._decisions.labels(outcome).inc()
        if outcome != self._last_outcome:
            self.sup.say(f"planner: hold: {reason}")
        self._last_outcome = outcome
        self.state.last_decision = reason

    def _sample(self, workers: list[WorkerInfo]) -> Sample:
        router = Scrape.parse(self.fetch(f"{self.router_url}/metrics"))
        scrapes = {}
        for w in workers:
            if w.metrics_address:
                try:
                    scrapes[w.worker_id] = Scrape.parse(
                        self.fetch(f"http://{w.metrics_address}/metrics")
                    )
                except OSError:
                    pass  # gone or restarting: no busy figures for it this window
        return Sample(self.clock(), router, scrapes)

    def _move(self, decision: Decision, worker: WorkerInfo) -> None:
        src, dst = decision.from_role or worker.role, decision.to_role or ""
        slot = self.sup.slot_of(worker.grpc_address)
        self.sup.say(
            f"planner: moving {slot or worker.worker_id} ({worker.grpc_address}) "
            f"{src} -> {dst}: {decision.reason}"
        )
        started = time.monotonic()
        error = ""
        try:
            self.switch(worker, dst)
        except Exception as exc:
            error = repr(exc)
        self._last_move_at = self.clock()  # a failed switch also waits out the cooldown
        self.window.clear()
        if error:
            self._failures.labels(src, dst).inc()
            self._decisions.labels("move_failed").inc()
            self.sup.say(
                f"planner: error: moving {slot or worker.worker_id} to {dst} failed: {error}"
            )
        else:
            self.sup.set_worker_role(worker.grpc_address, dst)
            self._moves.labels(src, dst).inc()
            self._decisions.labels(decision.outcome).inc()
            self.sup.say(
                f"planner: {slot or worker.worker_id} serves {dst} now "
                f"(switch took {time.monotonic() - started:.1f}s)"
            )
        self.state.move_count += 1
        self.state.moves.append(
            Move(
                time.time(),
                worker.worker_id,
                slot,
                src,
                dst,
                decision.reason,
                ok=not error,
                error=error,
            )
        )


def start_planner(sup: Supervisor, router_url: str, auth: ClusterAuth) -> Planner:
    """`up --planner`: the planner thread against this cluster's etcd, router and workers
    (its channels present `auth`, the cluster's token and TLS)."""
    c = sup.config.planner_config
    planner = Planner(
        sup,
        router_url,
        c,
        switch=grpc_set_role(c.drain_timeout_s, auth),
        read_workers=etcd_workers(sup.etcd, sup.config.cluster, sup.router_etcd.resolve()),
    )
    sup.planner = planner
    planner.start()
    sup.say(
        f"planner: on (TTFT <= {c.ttft_slo_ms:.0f} ms, ITL <= {c.itl_slo_ms:.0f} ms "
        f"at p{round(c.quantile * 100)}; every {c.interval_s:g}s over "
        f"{c.window_s:g}s windows; cooldown {c.cooldown_s:g}s)"
    )
    return planner
