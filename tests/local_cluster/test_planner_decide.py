"""planner.decide on hand-built snapshots: which pool is the bottleneck, minimums and maximums,
SLOs met, cooldown, hysteresis (a steady load never flaps), determinism."""

import dataclasses
import random

import pytest

from local_cluster.planner import PlannerConfig, Snapshot, WorkerLoad, decide

CONFIG = PlannerConfig()


def prefill(i: int, **kw) -> WorkerLoad:
    return WorkerLoad(worker_id=f"p{i}", role="prefill", **{"prefill_tokens_per_s": 1000.0, **kw})


def decode(i: int, **kw) -> WorkerLoad:
    return WorkerLoad(worker_id=f"d{i}", role="decode", **kw)


def snap(
    *workers: WorkerLoad, ttft=0.5, itl=0.1, rate=1.0, prompt=100.0, cached=0.0, requests=20
) -> Snapshot:
    return Snapshot(
        window_s=20.0,
        requests=requests,
        arrival_rate=rate,
        mean_prompt_tokens=prompt,
        cached_fraction=cached,
        mean_output_tokens=64.0,
        ttft_s=ttft,
        itl_s=itl,
        workers=tuple(workers),
    )


def saturated_decode(i: int) -> WorkerLoad:
    """Busy all window; 6 running sequences need 24 tokens/s to meet the ITL SLO, it makes 20
    per busy second (1.2); 1 request/s of 64 output tokens asks for 64/s (3.2)."""
    return decode(i, busy=1.0, running=6, tokens_per_busy_s=20.0, prefill_tokens_per_s=900.0)


def idle_decode(i: int, running: int = 1) -> WorkerLoad:
    """Busy 0.1 of the window: 1 request/s of 64 output tokens at 640 per busy second."""
    return decode(i, busy=0.1, running=running, tokens_per_busy_s=640.0)


def test_decode_saturated_with_idle_prefill_moves_the_prefill_worker_to_decode():
    d = decide(snap(prefill(1), saturated_decode(1), itl=0.4), CONFIG, None)
    assert d.is_move and d.outcome == "move_to_decode", d.reason
    assert (d.worker_id, d.from_role, d.to_role) == ("p1", "prefill", "decode")
    assert d.loads.decode == pytest.approx(3.2)  # 1 req/s x 64 tokens / 20 per busy second
    assert d.predicted.prefill is None  # no prefill pool left: decode workers prefill locally
    assert d.predicted.decode == pytest.approx((3.2 + 0.1) / 2)  # 1 req/s x 100 tokens / 1000
    assert "decode is the bottleneck" in d.reason and "ITL p90 400 ms > 250" in d.reason


def test_decode_load_is_the_largest_of_busy_itl_need_kv_and_throughput():
    def load(worker, **kw):
        return decide(snap(prefill(1), worker, **kw), CONFIG, None).loads.decode

    assert load(decode(1, busy=0.3, running=1, tokens_per_busy_s=640.0)) == pytest.approx(0.3)
    assert load(decode(1, busy=0.3, running=6, tokens_per_busy_s=40.0)) == pytest.approx(
        1.6
    )  # 64/40
    assert load(decode(1, busy=0.3, running=6, tokens_per_busy_s=40.0), rate=0.1) == pytest.approx(
        0.6
    )
    assert load(decode(1, busy=0.3, kv_used=0.7)) == pytest.approx(0.7)


def test_the_least_loaded_prefill_worker_is_the_one_moved():
    workers = (
        prefill(1, queued_prefill_tokens=500),
        prefill(2),
        prefill(3, queued_prefill_tokens=90),
        saturated_decode(1),
    )
    assert decide(snap(*workers, itl=0.4), CONFIG, None).worker_id == "p2"


def test_prefill_backlog_with_idle_decode_moves_a_decode_worker_only_when_there_are_two():
    backlog = dict(rate=2.0, prompt=2000.0, ttft=5.0)  # 4000 tokens/s into a 2000 tokens/s pool
    p = prefill(1, prefill_tokens_per_s=2000.0, queued_prefill_tokens=8000)
    d = decide(
        snap(p, idle_decode(1, running=3), idle_decode(2, running=1), **backlog), CONFIG, None
    )
    assert d.is_move and (d.worker_id, d.from_role, d.to_role) == ("d2", "decode", "prefill"), (
        d.reason
    )
    assert d.loads.prefill == pytest.approx(2.0) and d.predicted.prefill == pytest.approx(1.0)
    assert "prefill is the bottleneck" in d.reason

    alone = decide(snap(p, idle_decode(1), **backlog), CONFIG, None)
    assert not alone.is_move and alone.outcome == "at_limit", alone.reason


def test_within_slo_and_below_high_load_holds():
    workers = (prefill(1, busy=0.2), decode(1, busy=0.5, running=2, tokens_per_busy_s=160.0))
    d = decide(snap(*workers, ttft=0.4, itl=0.12), CONFIG, None)
    assert not d.is_move and d.outcome == "within_slo", d.reason
    assert "TTFT p90 400 ms <= 2000" in d.reason and "ITL p90 120 ms <= 250" in d.reason


def test_a_hot_pool_with_slos_met_is_still_relieved():
    d = decide(snap(prefill(1), saturated_decode(1), ttft=0.3, itl=0.2), CONFIG, None)
    assert d.outcome == "move_to_decode", d.reason


def test_the_last_prefill_worker_leaves_only_a_saturated_decode_pool():
    # ITL missed at decode load 0.5: not saturated; without a prefill pool local prefills
    # would stall decode steps, so the prefill worker stays ...
    half = decode(1, busy=0.5, running=1, tokens_per_busy_s=160.0)
    d = decide(snap(prefill(1), half, itl=0.4), CONFIG, None)
    assert not d.is_move and d.outcome == "keep_prefill_pool", d.reason
    # ... while a second prefill worker may go (one prefill worker is left).
    d = decide(snap(prefill(1), prefill(2), half, itl=0.4), CONFIG, None)
    assert d.outcome == "move_to_decode" and d.predicted.prefill is not None, d.reason


def test_cooldown_holds_after_a_move():
    s = snap(prefill(1), saturated_decode(1), itl=0.4)
    held = decide(s, CONFIG, since_last_move_s=10.0)
    assert not held.is_move and held.outcome == "cooldown", held.reason
    assert decide(s, CONFIG, since_last_move_s=31.0).is_move


def test_a_move_that_helps_less_than_the_hysteresis_is_not_made():
    # Decode at 0.9, prefill busy with 0.7 of a worker: 0P+2D would put (0.9 + 0.7) / 2 = 0.8
    # on each decode worker, only 0.1 better.
    workers = (
        prefill(1, prefill_tokens_per_s=1000.0),
        decode(1, busy=0.9, running=1, tokens_per_busy_s=80.0),
    )
    d = decide(snap(*workers, prompt=700.0), CONFIG, None)
    assert not d.is_move and d.outcome == "no_gain", d.reason
    assert decide(
        snap(*workers, prompt=700.0), dataclasses.replace(CONFIG, hysteresis=0.05), None
    ).is_move


class Cluster:
    """A steady load whose measurements follow the model: prefill work 0.3 of a worker (local
    or on the prefill pool), `decode_work` workers of decoding, spread evenly over each pool
    (busy shares cap at 1); the ITL misses while a decode worker is over 0.9."""

    def __init__(self, n_prefill: int, n_decode: int, decode_work: float):
        self.roles = {f"w{i}": "prefill" for i in range(n_prefill)}
        self.roles.update({f"w{n_prefill + i}": "decode" for i in range(n_decode)})
        self.decode_work = decode_work

    def snapshot(self) -> Snapshot:
        n_p = sum(r == "prefill" for r in self.roles.values())
        n_d = len(self.roles) - n_p
        d_load = (self.decode_work + (0.3 if n_p == 0 else 0.0)) / n_d
        workers = [
            WorkerLoad(
                w,
                r,
                prefill_tokens_per_s=1000.0,
                busy=min(1.0, 0.3 / n_p if r == "prefill" else d_load),
            )
            for w, r in sorted(self.roles.items())
        ]
        return snap(*workers, prompt=300.0, itl=0.4 if d_load > 0.9 else 0.15)


@pytest.mark.parametrize("decode_work", [1.2, 1.7])
def test_a_steady_load_moves_once_and_never_flaps(decode_work):
    # 1.7: still hot after the move (0.85 per decode worker, ITL missed), yet moving a worker
    # back to prefill would leave 1.7 on one decode worker: it stays.
    cluster, last_move, moves = Cluster(1, 1, decode_work), None, []
    for t in range(0, 600, 5):
        d = decide(cluster.snapshot(), CONFIG, None if last_move is None else t - last_move)
        if d.is_move:
            cluster.roles[d.worker_id] = d.to_role
            last_move = t
            moves.append((d.worker_id, d.to_role))
    assert moves == [("w0", "decode")]
    assert decide(cluster.snapshot(), CONFIG, None).outcome == (
        "within_slo" if decode_work < 1.5 else "at_limit"
    )


def test_minimums_and_maximums_are_respected():
    s = snap(prefill(1), saturated_decode(1), itl=0.4)
    for config in (
        dataclasses.replace(CONFIG, min_prefill=1),
        dataclasses.replace(CONFIG, max_decode=1),
        dataclasses.replace(CONFIG, min_prefill=1, max_prefill=1, min_decode=1, max_decode=1),
    ):
        d = decide(s, config, None)
        assert not d.is_move and d.outcome == "at_limit", (config, d.reason)

    backlog = snap(
        prefill(1, queued_prefill_tokens=50_000), idle_decode(1), idle_decode(2), ttft=9.0
    )
    assert decide(backlog, CONFIG, None).to_role == "prefill"
    assert not decide(backlog, dataclasses.replace(CONFIG, min_decode=2), None).is_move
    assert not decide(backlog, dataclasses.replace(CONFIG, max_prefill=1), None).is_move


def test_the_decode_pool_never_goes_below_one():
    # Prefill starved, one decode worker doing nothing: still no move to prefill.
    s = snap(idle_decode(1), ttft=9.0, rate=3.0, prompt=3000.0)
    assert not decide(s, dataclasses.replace(CONFIG, min_decode=1), None).is_move
    with pytest.raises(ValueError, match="min_decode"):
        PlannerConfig(min_decode=0)
    with pytest.raises(ValueError, match="max_prefill"):
        PlannerConfig(min_prefill=2, max_prefill=1)


def test_local_prefills_stalling_decode_steps_bring_a_prefill_pool_back():
    # No prefill pool; ITL misses although the decode pool has headroom (0.4 each): long
    # prompts prefilled locally stall the decode steps. A prefill worker leaves decode at 0.6.
    workers = (
        decode(1, busy=0.4, running=1, tokens_per_busy_s=40.0, prefill_tokens_per_s=1000.0),
        decode(2, busy=0.4, running=2, tokens_per_busy_s=40.0, prefill_tokens_per_s=1000.0),
    )
    d = decide(snap(*workers, itl=0.9, rate=0.1, prompt=2000.0), CONFIG, None)
    assert d.is_move and (d.worker_id, d.to_role) == ("d1", "prefill"), d.reason
    assert d.predicted.decode == pytest.approx(0.6) and d.predicted.prefill == pytest.approx(0.2)
    # Saturated instead: the remaining decode worker could not take the load; hold.
    busy = tuple(dataclasses.replace(w, busy=0.9) for w in workers)
    assert not decide(snap(*busy, itl=0.9, rate=0.1, prompt=2000.0), CONFIG, None).is_move


def test_no_move_without_enough_signal_or_while_a_worker_drains():
    s = snap(prefill(1), saturated_decode(1), itl=0.4, requests=2)
    assert decide(s, CONFIG, None).outcome == "no_signal"
    draining = snap(prefill(1, draining=True), saturated_decode(1), saturated_decode(2), itl=0.4)
    assert decide(draining, CONFIG, None).outcome == "draining"


def test_the_decision_depends_on_the_snapshot_only():
    workers = [prefill(1), prefill(2), saturated_decode(1), saturated_decode(2), idle_decode(3)]
    first = decide(snap(*workers, itl=0.4), CONFIG, None)
    for seed in range(5):
        random.Random(seed).shuffle(workers)
        assert decide(snap(*workers, itl=0.4), CONFIG, None) == first
