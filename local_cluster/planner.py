"""The planner's decision: which worker (if any) changes role, from one window of measurements.

Pure and deterministic: `decide(snapshot, config, last_move_at)` reads nothing else (no clock,
no I/O), so the same snapshot always gives the same decision. planner_loop.py gathers the
snapshot (etcd registrations, the router's and the workers' /metrics) and carries the move out.

The model, in "busy workers" (one worker fully busy = 1.0):
- prefill work  W_p = arrival rate x uncached prompt tokens / one prefill worker's measured
  prefill rate (tokens/s, from its registration); a prefill pool's load is W_p / n_prefill,
  or the time its queued prefill tokens take to clear over the TTFT SLO, whichever is larger.
- decode work   W_d = sum over decode workers of the largest of: the share of the window spent
  in engine steps, the tokens/s its running sequences need to meet the ITL SLO (running /
  ITL SLO) over the tokens it makes per busy second, and its KV usage; or, if larger, arrival
  rate x mean output tokens over one decode worker's tokens per busy second (this one sees an
  overload beyond "busy all the time"). A decode pool's load is W_d / n_decode. With no
  prefill pool the decode workers prefill locally, so W_d already holds that prefill work.
A move's prediction spreads the same work over the new pool sizes (work leaving or joining
the decode pool with the last prefill worker, or the first). The bottleneck is the larger
pool load. A move happens only when a pool is hot (its SLO is missed at the configured
quantile, or its load is at least `high_load`), the move lowers the bottleneck by at least
`hysteresis`, no pool drops below its minimum (or rises above its maximum), no worker is
draining, the window saw at least `min_requests` requests, and `cooldown_s` passed since the
last move. The reverse of a move that paid off predicts a bottleneck higher by at least the
hysteresis, so a steady load never flaps.

Two more rules, for interference the load model cannot see (without a prefill pool, long
local prefills stall the decode steps of the sequences batched with them):
- the last prefill worker moves to decode only when the decode pool is saturated (load at
  least `high_load`), not on an SLO miss alone;
- with no prefill pool, inter-token gaps that miss the ITL SLO while the decode pool has
  headroom mean local prefills stall decode steps; a decode worker then moves to prefill if
  the pool loads predicted after the move stay below `high_load`.
The two agree: the decode load predicted for bringing the prefill pool back is the load that
made it leave, so a steady load does not bounce between them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.roles import Role
from engine.checks import check_fields
from engine.flags import option


@dataclass(frozen=True)
class PlannerConfig:
    """`pdserve up --planner`'s settings: the SLOs and limits `decide` holds the pools to, and
    how often and over what window planner_loop.py measures."""

    ttft_slo_ms: float = 2000.0
    """Time-to-first-token SLO the planner holds the window's quantile to."""
    itl_slo_ms: float = 250.0
    """Inter-token-gap SLO the planner holds the window's quantile to."""
    quantile: float = option(0.9, name="--planner-quantile")
    """Quantile of the window's TTFTs and ITLs compared with the SLOs."""
    min_prefill: int = 0
    """The planner keeps at least this many prefill workers (0: decode workers prefill
    locally)."""
    max_prefill: int | None = None
    """At most this many prefill workers (default: no cap)."""
    min_decode: int = 1
    """At least this many decode workers (at least 1: someone must decode)."""
    max_decode: int | None = None
    """At most this many decode workers (default: no cap)."""
    cooldown_s: float = option(30.0, name="--planner-cooldown")
    """Seconds after a move before the next one."""
    hysteresis: float = option(0.15, name="--planner-hysteresis")
    """A move must lower the bottleneck pool's load (1 = saturated) by this much."""
    high_load: float = option(0.85, name="--planner-high-load")
    """A pool at this load is relieved even while its SLO holds."""
    min_requests: int = option(3, name="--planner-min-requests")
    """Fewer requests in the window: the planner does not act."""
    interval_s: float = option(5.0, name="--planner-interval")
    """Seconds between planner rounds (measure, decide, maybe move)."""
    window_s: float = option(20.0, name="--planner-window")
    """Seconds of measurements each decision looks at."""
    drain_timeout_s: float = option(30.0, name="--planner-drain-timeout")
    """Seconds a switching worker waits for its in-flight requests."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            [
                (self.ttft_slo_ms > 0, "ttft_slo_ms", "must be > 0"),
                (self.itl_slo_ms > 0, "itl_slo_ms", "must be > 0"),
                (0 < self.quantile < 1, "quantile", "must be between 0 and 1"),
                (self.min_prefill >= 0, "min_prefill", "must be >= 0"),
                (
                    self.max_prefill is None or self.max_prefill >= self.min_prefill,
                    "max_prefill",
                    f"must be >= min_prefill ({self.min_prefill})",
                ),
                (self.min_decode >= 1, "min_decode", "must be >= 1"),
                (
                    self.max_decode is None or self.max_decode >= self.min_decode,
                    "max_decode",
                    f"must be >= min_decode ({self.min_decode})",
                ),
                (self.cooldown_s >= 0, "cooldown_s", "must be >= 0"),
                (self.hysteresis >= 0, "hysteresis", "must be >= 0"),
                (self.high_load > 0, "high_load", "must be > 0"),
                (self.min_requests >= 0, "min_requests", "must be >= 0"),
                (self.interval_s > 0, "interval_s", "must be > 0"),
                (self.window_s > 0, "window_s", "must be > 0"),
                (self.drain_timeout_s >= 0, "drain_timeout_s", "must be >= 0"),
            ],
        )

    @property
    def ttft_slo_s(self) -> float:
        return self.ttft_slo_ms / 1000

    @property
    def itl_slo_s(self) -> float:
        return self.itl_slo_ms / 1000


@dataclass(frozen=True)
class WorkerLoad:
    """One registered worker as measured over the window."""

    worker_id: str
    role: Role
    draining: bool = False
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    """Its measured prefill rate (registration; 0 = not measured yet)."""
    busy: float = 0.0
    """Share of the window spent in engine steps (0..1)."""
    tokens_per_busy_s: float = 0.0
    """Tokens generated per second of engine steps over the window (0 = none generated)."""
    kv_used: float = 0.0
    """Share of its KV blocks in use (not free and not cached-free)."""


@dataclass(frozen=True)
class Snapshot:
    """The measurements of one window."""

    window_s: float
    requests: int
    """Requests that got their first token in the window."""
    arrival_rate: float
    """Requests per second arriving at the router."""
    mean_prompt_tokens: float
    cached_fraction: float
    """Share of prompt tokens the workers found in their prefix caches."""
    mean_output_tokens: float
    ttft_s: float | None
    """The window's TTFT at the configured quantile (None: no samples)."""
    itl_s: float | None
    """The window's inter-token gap at the configured quantile (None: no samples)."""
    workers: tuple[WorkerLoad, ...]


@dataclass(frozen=True)
class PoolLoads:
    prefill: float | None
    """None: no prefill pool (decode workers prefill locally)."""
    decode: float

    @property
    def bottleneck(self) -> float:
        return max(self.decode, self.prefill or 0.0)


@dataclass(frozen=True)
class Decision:
    outcome: str
    """Short and stable (a metric label): move_to_decode, move_to_prefill, or why it holds."""
    reason: str
    loads: PoolLoads
    worker_id: str | None = None
    """The worker to switch; None: hold."""
    from_role: Role | None = None
    to_role: Role | None = None
    predicted: PoolLoads | None = None
    """Pool loads expected after the move."""

    @property
    def is_move(self) -> bool:
        return self.worker_id is not None


def decide(snap: Snapshot, config: PlannerConfig, since_last_move_s: float | None) -> Decision:
    """The move to make now (or a hold), with the reason. `since_last_move_s`: seconds since
    the last move (None: none yet)."""
    active = [w for w in snap.workers if not w.draining]
    prefill = sorted((w for w in active if w.role == Role.PREFILL), key=lambda w: w.worker_id)
    decode = sorted((w for w in active if w.role == Role.DECODE), key=lambda w: w.worker_id)
    work = _work(snap, config, prefill, decode)
    loads = work.loads(len(prefill), len(decode))

    def hold(outcome: str, reason: str) -> Decision:
        return Decision(outcome, reason, loads)

    if not decode:
        return hold("no_decode", "no decode worker registered")
    if any(w.draining for w in snap.workers):
        return hold("draining", "a worker is draining (a role switch or scale-in in progress)")
    if snap.requests < config.min_requests:
        return hold(
            "no_signal",
            f"{snap.requests} requests in the window (< {config.min_requests}): too little signal",
        )
    if since_last_move_s is not None and since_last_move_s < config.cooldown_s:
        return hold(
            "cooldown",
            f"cooling down ({since_last_move_s:.0f}s of "
            f"{config.cooldown_s:.0f}s since the last move)",
        )

    ttft_miss = snap.ttft_s is not None and snap.ttft_s > config.ttft_slo_s
    itl_miss = snap.itl_s is not None and snap.itl_s > config.itl_slo_s
    decode_hot = (
        itl_miss
        or loads.decode >= config.high_load
        or (ttft_miss and (loads.prefill is None or loads.decode >= loads.prefill))
    )
    prefill_hot = loads.prefill is not None and (
        loads.prefill >= config.high_load or (ttft_miss and loads.prefill > loads.decode)
    )
    slo = _slo_text(snap, config, ttft_miss, itl_miss)
    if not (decode_hot or prefill_hot):
        return hold(
            "within_slo",
            f"{slo}; loads prefill {_fmt(loads.prefill)} decode {loads.decode:.2f} "
            f"below {config.high_load:.2f}",
        )

    n_p, n_d = len(prefill), len(decode)
    can_to_decode = n_p > config.min_prefill and (
        config.max_decode is None or n_d < config.max_decode
    )
    can_to_prefill = n_d > config.min_decode and (
        config.max_prefill is None or n_p < config.max_prefill
    )
    # The last prefill worker leaves only for a saturated decode pool: without a prefill pool,
    # long local prefills stall decode steps (which the load model does not see), so an SLO
    # miss at moderate decode load is no reason to give disaggregation up.
    keep_last_prefill = n_p == 1 and loads.decode < config.high_load
    to_decode = can_to_decode and not keep_last_prefill

    if decode_hot and not prefill_hot:
        interference = _interference_move(
            config, work, decode, loads, slo, itl_miss, can_to_prefill
        )
        if not can_to_decode:
            return interference or hold(
                "at_limit",
                f"decode is the bottleneck ({slo}, decode load {loads.decode:.2f}) but "
                f"the prefill pool is at its minimum or decode at its maximum",
            )
        if keep_last_prefill:
            return hold(
                "keep_prefill_pool",
                f"{slo}, but decode load {loads.decode:.2f} is below "
                f"{config.high_load:.2f}: keeping the last prefill worker",
            )
        after = work.loads(n_p - 1, n_d + 1)
        if after.bottleneck <= loads.bottleneck - config.hysteresis:
            return Decision(
                "move_to_decode",
                f"decode is the bottleneck ({slo}, decode load "
                f"{loads.decode:.2f}); moving a prefill worker lowers it to "
                f"{after.bottleneck:.2f}",
                loads,
                _prefill_donor(prefill),
                Role.PREFILL,
                Role.DECODE,
                after,
            )
        return interference or hold(
            "no_gain",
            f"decode is hot ({slo}, decode load {loads.decode:.2f}) but moving a "
            f"prefill worker would only reach {after.bottleneck:.2f}",
        )

    candidates: list[Decision] = []
    if can_to_prefill:
        after = work.loads(n_p + 1, n_d - 1)
        candidates.append(
            Decision(
                "move_to_prefill",
                f"prefill is the bottleneck ({slo}, prefill load "
                f"{_fmt(loads.prefill)}); moving a decode worker lowers it to "
                f"{after.bottleneck:.2f}",
                loads,
                _decode_donor(decode),
                Role.DECODE,
                Role.PREFILL,
                after,
            )
        )
    if decode_hot and to_decode:  # both hot: whichever move helps more
        after = work.loads(n_p - 1, n_d + 1)
        candidates.append(
            Decision(
                "move_to_decode",
                f"both pools are hot ({slo}); moving a prefill worker lowers the "
                f"bottleneck to {after.bottleneck:.2f}",
                loads,
                _prefill_donor(prefill),
                Role.PREFILL,
                Role.DECODE,
                after,
            )
        )
    if not candidates:
        return hold(
            "at_limit",
            f"prefill is the bottleneck ({slo}, prefill load "
            f"{_fmt(loads.prefill)}) but the decode pool is at its minimum or prefill "
            f"at its maximum",
        )
    best = min(candidates, key=lambda d: (d.predicted.bottleneck, d.to_role))  # type: ignore[union-attr]
    if best.predicted.bottleneck <= loads.bottleneck - config.hysteresis:  # type: ignore[union-attr]
        return best
    return hold(
        "no_gain",
        f"prefill is hot ({slo}, prefill load {_fmt(loads.prefill)}) but no "
        f"move lowers the bottleneck {loads.bottleneck:.2f} by {config.hysteresis:.2f}",
    )


def _prefill_donor(prefill: list[WorkerLoad]) -> str:
    """The prefill worker with the least queued work (the shortest drain)."""
    return min(prefill, key=lambda w: (w.queued_prefill_tokens, w.worker_id)).worker_id


def _decode_donor(decode: list[WorkerLoad]) -> str:
    """The decode worker with the fewest sequences (the fewest to finish or migrate)."""
    return min(decode, key=lambda w: (w.running + w.waiting, w.worker_id)).worker_id


@dataclass(frozen=True)
class _Work:
    """Prefill and decode work in busy workers, and the prefill rate of one worker."""

    prefill: float | None
    """Prefill work (None: unknown, no prefill rate measured anywhere)."""
    prefill_backlog: float
    """Seconds the queued prefill tokens take on one prefill worker, over the TTFT SLO."""
    decode: float
    prefill_in_decode: bool
    """No prefill pool now: `decode` includes the prefill work."""

    def loads(self, n_prefill: int, n_decode: int) -> PoolLoads:
        """Pool loads with the same work spread over these pool sizes."""
        p_work = self.prefill or 0.0
        d_work = self.decode
        if self.prefill_in_decode and n_prefill > 0:
            d_work = max(0.0, d_work - p_work)  # a new prefill pool takes the local prefills
        elif not self.prefill_in_decode and n_prefill == 0:
            d_work += p_work  # the decode pool prefills locally now
        decode = d_work / max(1, n_decode)
        if n_prefill == 0:
            return PoolLoads(None, decode)
        return PoolLoads(max(p_work, self.prefill_backlog) / n_prefill, decode)


def _work(
    snap: Snapshot, config: PlannerConfig, prefill: list[WorkerLoad], decode: list[WorkerLoad]
) -> _Work:
    demand = snap.arrival_rate * snap.mean_prompt_tokens * (1.0 - snap.cached_fraction)
    measured = [w.prefill_tokens_per_s for w in (prefill or decode) if w.prefill_tokens_per_s > 0]
    rate = sum(measured) / len(measured) if measured else 0.0
    if rate > 0:
        p_work: float | None = demand / rate
        backlog = sum(w.queued_prefill_tokens for w in prefill) / rate / config.ttft_slo_s
    else:  # never prefilled yet: what the prefill workers were busy with, if any
        p_work = sum(w.busy for w in prefill) if prefill else None
        backlog = 0.0
    d_work = sum(_decode_load(w, config) for w in decode)
    speeds = [w.tokens_per_busy_s for w in decode if w.tokens_per_busy_s > 0]
    if speeds:  # output tokens asked for vs made per busy second: sees past busy = 1
        d_work = max(
            d_work, snap.arrival_rate * snap.mean_output_tokens / (sum(speeds) / len(speeds))
        )
    return _Work(p_work, backlog, d_work, prefill_in_decode=not prefill)


def _decode_load(w: WorkerLoad, config: PlannerConfig) -> float:
    itl_need = 0.0
    if w.tokens_per_busy_s > 0:
        itl_need = w.running / config.itl_slo_s / w.tokens_per_busy_s
    return max(w.busy, itl_need, w.kv_used)


def _interference_move(
    config: PlannerConfig,
    work: _Work,
    decode: list[WorkerLoad],
    loads: PoolLoads,
    slo: str,
    itl_miss: bool,
    can_to_prefill: bool,
) -> Decision | None:
    """No prefill pool, ITL missed, decode not saturated: local prefills stall decode steps;
    bring a prefill pool back if the decode pool left keeps its load below high_load."""
    if not (itl_miss and loads.prefill is None and can_to_prefill and work.prefill is not None):
        return None
    after = work.loads(1, len(decode) - 1)
    if after.bottleneck >= config.high_load:
        return None
    return Decision(
        "move_to_prefill",
        f"{slo} with decode load {loads.decode:.2f}: local "
        f"prefills stall decode steps; a prefill pool leaves decode at {after.decode:.2f}",
        loads,
        _decode_donor(decode),
        Role.DECODE,
        Role.PREFILL,
        after,
    )


def _slo_text(snap: Snapshot, config: PlannerConfig, ttft_miss: bool, itl_miss: bool) -> str:
    q = f"p{round(config.quantile * 100)}"
    parts = []
    if snap.ttft_s is not None:
        parts.append(
            f"TTFT {q} {snap.ttft_s * 1000:.0f} ms {'>' if ttft_miss else '<='} "
            f"{config.ttft_slo_s * 1000:.0f}"
        )
    if snap.itl_s is not None:
        parts.append(
            f"ITL {q} {snap.itl_s * 1000:.0f} ms {'>' if itl_miss else '<='} "
            f"{config.itl_slo_s * 1000:.0f}"
        )
    return ", ".join(parts) or "no latency samples"


def _fmt(load: float | None) -> str:
    return "-" if load is None else f"{load:.2f}"
