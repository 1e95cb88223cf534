"""The planner's measurements and loop without processes: the router's real /metrics text
(router/metrics.py) parsed into a window's snapshot, histogram quantiles, one planner round
against fake etcd / workers / SetRole moving a prefill worker to decode, the slot following
the switch (a crash restarts it in the new role), and `up` without --planner pinning pools."""

import math
import time
from pathlib import Path

import pytest

from cluster.registration import Capacity, WorkerInfo
from engine.flags import from_args
from local_cluster.config import UpConfig
from local_cluster.measure import Sample, Window
from local_cluster.metrics_text import Scrape, increase, quantile, window_buckets
from local_cluster.planner import PlannerConfig
from local_cluster.planner_loop import Planner
from local_cluster.slots import RestartPolicy, SlotState
from local_cluster.supervisor import Supervisor
from router.metrics import RouterMetrics


def test_histogram_quantile_interpolates_within_the_bucket():
    buckets = {0.1: 0.0, 0.25: 5.0, 0.5: 10.0, math.inf: 10.0}
    assert quantile(buckets, 0.9) == pytest.approx(0.25 + 0.25 * 4 / 5)
    assert quantile(buckets, 0.5) == pytest.approx(0.25)
    assert quantile({0.5: 0.0, math.inf: 3.0}, 0.9) == 0.5  # above every bound: the largest
    assert quantile({0.5: 0.0, math.inf: 0.0}, 0.9) is None


def test_router_metrics_text_gives_the_windows_figures():
    m = RouterMetrics()
    m.ttft.observe(5.0)  # before the window
    before = Scrape.parse(m.render().decode())
    for ttft in (0.2, 0.3, 0.4, 3.0):
        m.ttft.observe(ttft)
    for itl in [0.02] * 30 + [0.4] * 10:
        m.itl.observe(itl)
    m.prompt_tokens.inc(400)
    m.prefix_hit_tokens.labels("reported").inc(100)
    m.prefix_hit_tokens.labels("predicted").inc(400)  # not what the workers found
    m.generation_tokens.inc(256)
    for _ in range(4):
        m.e2e.observe(1.0)
    after = Scrape.parse(m.render().decode())

    assert increase(after, before, "pdserve_router_prompt_tokens_total") == 400
    assert increase(after, None, "pdserve_router_ttft_seconds_count") == 5
    assert increase(before, after, "pdserve_router_prompt_tokens_total") == 0  # a restart
    ttft = window_buckets(after, before, "pdserve_router_ttft_seconds")
    assert ttft[math.inf] == 4 and ttft[2.5] == 3

    window = Window(window_s=8.0)
    window.add(Sample(0.0, before, {}))
    assert window.snapshot([], 0.9) is None
    window.add(Sample(4.0, before, {}))
    assert window.snapshot([], 0.9) is None  # half the window: not yet
    window.add(Sample(8.0, after, {}))
    s = window.snapshot([], 0.9)
    assert s.requests == 4 and s.arrival_rate == pytest.approx(0.5)
    assert s.mean_prompt_tokens == 100 and s.cached_fraction == pytest.approx(0.25)
    assert s.mean_output_tokens == 64
    assert 2.5 <= s.ttft_s <= 5.0  # the 3 s one is the 90th percentile
    assert 0.25 < s.itl_s <= 0.5


def test_the_window_keeps_the_last_window_s_of_scrapes():
    m = RouterMetrics()
    window = Window(window_s=10.0)
    for t in (0.0, 5.0, 10.0, 15.0):
        window.add(Sample(t, Scrape.parse(m.render().decode()), {}))
        m.ttft.observe(0.1)  # one request every 5 s
    s = window.snapshot([], 0.9)
    assert s.window_s == 10.0 and s.requests == 2 and s.arrival_rate == pytest.approx(0.2)
    window.clear()
    assert window.snapshot([], 0.9) is None


def worker_text(step_s: float, tokens: int, role: str) -> str:
    return (
        f"# TYPE pdserve_worker_engine_step_seconds counter\n"
        f'pdserve_worker_engine_step_seconds_total{{role="{role}"}} {step_s}\n'
        f"# TYPE pdserve_worker_generation_tokens counter\n"
        f'pdserve_worker_generation_tokens_total{{role="{role}"}} {tokens}\n'
    )


class FakeChild:
    def __init__(self, pid: int, grpc_address: str):
        self.pid, self.grpc_address, self.code = pid, grpc_address, None

    def alive(self):
        return self.code is None

    def exit_code(self):
        return self.code

    def ready(self):
        return True

    def terminate(self):
        self.code = 0
        return 0

    def kill(self):
        self.code = -9


class FakeCluster:
    """etcd registrations, the router's and the workers' /metrics, and Worker.SetRole, in
    memory: 1 prefill worker idle, 1 decode worker saturated with ITLs of 400 ms."""

    def __init__(self):
        self.router = RouterMetrics()
        self.workers = {
            "p1": WorkerInfo(
                "p1",
                "prefill",
                "127.0.0.1:7001",
                "m",
                "h",
                16,
                metrics_address="127.0.0.1:9001",
                capacity=Capacity(100, 100, prefill_tokens_per_s=1000.0),
            ),
            "d1": WorkerInfo(
                "d1",
                "decode",
                "127.0.0.1:7002",
                "m",
                "h",
                16,
                metrics_address="127.0.0.1:9002",
                capacity=Capacity(100, 60, running=6),
            ),
        }
        self.busy = {"p1": 0.0, "d1": 0.0}
        self.tokens = {"p1": 0, "d1": 0}
        self.switched: list[tuple[str, str]] = []

    def advance(self, seconds: float) -> None:
        """`seconds` of 1 request/s of 100-token prompts; the decode worker busy all along."""
        for _ in range(int(seconds)):
            self.router.ttft.observe(0.5)
            self.router.e2e.observe(3.0)
            self.router.prompt_tokens.inc(100)
            self.router.generation_tokens.inc(64)
            for _ in range(63):
                self.router.itl.observe(0.4)
        self.busy["d1"] += seconds
        self.busy["p1"] += 0.1 * seconds
        self.tokens["d1"] += int(20 * seconds)

    def fetch(self, url: str) -> str:
        if url.startswith("http://router"):
            return self.router.render().decode()
        wid = next(w.worker_id for w in self.workers.values() if w.metrics_address in url)
        return worker_text(self.busy[wid], self.tokens[wid], self.workers[wid].role)

    def set_role(self, worker: WorkerInfo, role: str) -> None:
        self.switched.append((worker.worker_id, role))
        self.workers[worker.worker_id] = WorkerInfo(**{**worker.__dict__, "role": role})


def make_supervisor(spawned: list) -> Supervisor:
    sup = Supervisor(
        UpConfig(num_threads=1, cluster="test", restart=RestartPolicy(backoff=0.0)),
        "127.0.0.1:1",
        Path("/nonexistent-logs"),
    )
    sup._spawn_worker = lambda role, name: (
        spawned.append((role, name)) or FakeChild(len(spawned), "")
    )
    return sup


def test_a_round_moves_the_idle_prefill_worker_to_decode_and_its_slot_follows():
    cluster, spawned, now = FakeCluster(), [], [0.0]
    sup = make_supervisor(spawned)
    sup.say = lambda msg: None
    p_slot, d_slot = sup.add_slot("prefill"), sup.add_slot("decode")
    p_slot.child, d_slot.child = FakeChild(1, "127.0.0.1:7001"), FakeChild(2, "127.0.0.1:7002")
    p_slot.state = d_slot.state = SlotState.READY
    planner = Planner(
        sup,
        "http://router",
        PlannerConfig(cooldown_s=30.0, window_s=10.0),
        switch=cluster.set_role,
        read_workers=lambda: list(cluster.workers.values()),
        fetch=cluster.fetch,
        clock=lambda: now[0],
    )
    sup.planner = planner  # as start_planner does

    assert planner.round() is None  # one scrape: no window yet
    cluster.advance(10)
    now[0] = 10.0
    decision = planner.round()
    assert decision.is_move and decision.worker_id == "p1", decision.reason
    assert cluster.switched == [("p1", "decode")]
    assert p_slot.role == "decode" and p_slot.name == "prefill-1"
    assert planner.view()["move_count"] == 1
    move = planner.view()["moves"][0]
    assert (move["slot"], move["from_role"], move["to_role"], move["ok"]) == (
        "prefill-1",
        "prefill",
        "decode",
        True,
    )
    text = planner.metrics_text().decode()
    assert 'pdserve_planner_moves_total{from_role="prefill",to_role="decode"} 1.0' in text
    assert sup.snapshot()["planner"]["moves"][0]["worker_id"] == "p1"

    # The next rounds refill the window and then wait out the cooldown; no second move.
    for t in (15.0, 20.0, 25.0):
        cluster.advance(5)
        now[0] = t
        d = planner.round()
        assert d is None or not d.is_move
    assert cluster.switched == [("p1", "decode")]
    assert planner.round().outcome == "cooldown"
    text = planner.metrics_text().decode()
    assert 'pdserve_planner_pool_size{role="decode"} 2.0' in text
    assert 'pdserve_planner_pool_size{role="prefill"} 0.0' in text

    # The switched worker crashes: its slot restarts it as a decode worker.
    p_slot.child.code = -9
    sup._step(p_slot, time.monotonic())
    assert p_slot.state is SlotState.RESTARTING
    sup._step(p_slot, time.monotonic() + 1)
    assert spawned == [("decode", "prefill-1")]


def test_a_failed_switch_is_counted_and_the_slot_keeps_its_role():
    cluster, now = FakeCluster(), [0.0]
    sup = make_supervisor([])
    said = []
    sup.say = said.append
    slot = sup.add_slot("prefill")
    slot.child, slot.state = FakeChild(1, "127.0.0.1:7001"), SlotState.READY

    def refuse(worker, role):
        raise RuntimeError("FAILED_PRECONDITION: sleeping")

    planner = Planner(
        sup,
        "http://router",
        PlannerConfig(window_s=10.0),
        switch=refuse,
        read_workers=lambda: list(cluster.workers.values()),
        fetch=cluster.fetch,
        clock=lambda: now[0],
    )
    planner.round()
    cluster.advance(10)
    now[0] = 10.0
    assert planner.round().is_move
    assert slot.role == "prefill"
    assert not planner.view()["moves"][0]["ok"]
    assert any("failed" in m for m in said)
    assert (
        'pdserve_planner_move_failures_total{from_role="prefill",to_role="decode"} 1.0'
        in planner.metrics_text().decode()
    )


def test_no_decision_while_a_worker_restarts_or_after_the_pools_changed():
    cluster, now = FakeCluster(), [0.0]
    sup = make_supervisor([])
    said = []
    sup.say = said.append
    slot = sup.add_slot("prefill")
    slot.child, slot.state = FakeChild(1, "127.0.0.1:7001"), SlotState.RESTARTING
    planner = Planner(
        sup,
        "http://router",
        PlannerConfig(window_s=10.0),
        switch=cluster.set_role,
        read_workers=lambda: list(cluster.workers.values()),
        fetch=cluster.fetch,
        clock=lambda: now[0],
    )
    planner.round()
    cluster.advance(10)
    now[0] = 10.0
    assert planner.round() is None and cluster.switched == []
    assert said == ["planner: hold: a worker is starting or restarting"]
    assert (
        'pdserve_planner_decisions_total{outcome="settling"} 2.0' in planner.metrics_text().decode()
    )

    # Back, with one more decode worker registered: a new window starts.
    slot.state = SlotState.READY
    cluster.workers["d2"] = WorkerInfo("d2", "decode", "127.0.0.1:7003", "m", "h", 16)
    cluster.advance(5)
    now[0] = 15.0
    assert planner.round() is None  # the 10 s before described other pools
    cluster.advance(10)
    now[0] = 25.0
    assert planner.round() is not None


def test_slots_follow_the_registered_role():
    sup = make_supervisor([])
    slot = sup.add_slot("decode")
    slot.child = FakeChild(1, "127.0.0.1:7002")
    info = WorkerInfo("d1", "prefill", "127.0.0.1:7002", "m", "h", 16)
    sup.follow_registrations([WorkerInfo(**{**info.__dict__, "draining": True})])
    assert slot.role == "decode"  # mid-switch: not yet
    sup.follow_registrations([info])
    assert slot.role == "prefill"
    sup.follow_registrations([WorkerInfo(**{**info.__dict__, "grpc_address": "127.0.0.1:1"})])
    assert slot.role == "prefill"  # somebody else's worker


def test_without_planner_the_pools_stay_pinned():
    from pdserve.cli import build_parser

    def parse(*flags: str) -> UpConfig:
        return from_args(UpConfig, build_parser().parse_args(["up", *flags]))

    config = parse("--prefill", "2", "--decode", "3")
    assert not config.planner
    sup = Supervisor(config, "127.0.0.1:1", Path("/nonexistent-logs"))
    assert sup.planner is None and "planner" not in sup.snapshot()

    config = parse(
        "--planner",
        "--ttft-slo-ms",
        "1500",
        "--itl-slo-ms",
        "100",
        "--min-prefill",
        "1",
        "--max-decode",
        "3",
        "--planner-interval",
        "2",
        "--planner-drain-timeout",
        "9",
    )
    c = config.planner_config
    assert config.planner and (c.ttft_slo_s, c.itl_slo_s, c.min_prefill, c.max_decode) == (
        1.5,
        0.1,
        1,
        3,
    )
    assert (c.min_decode, c.cooldown_s, c.interval_s, c.window_s, c.drain_timeout_s) == (
        1,
        30.0,
        2.0,
        20.0,
        9.0,
    )
    with pytest.raises(ValueError, match="--min-decode: min_decode must be >= 1"):
        parse("--planner", "--min-decode", "0")


def test_bad_planner_flags_stop_up_before_it_starts_anything(capsys):
    from pdserve.cli import main

    assert main(["up", "--planner", "--min-prefill", "2", "--max-prefill", "1"]) == 2
    assert (
        "pdserve up: error: --max-prefill: max_prefill must be >= min_prefill (2), got 1"
        in capsys.readouterr().err
    )
    assert main(["up", "--planner", "--planner-interval", "0"]) == 2
    assert "--planner-interval: interval_s must be > 0" in capsys.readouterr().err
