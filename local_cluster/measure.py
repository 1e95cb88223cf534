"""The planner's measurements: scrapes of the router's and the workers' /metrics over time, and
the planner.Snapshot of the window between the oldest kept scrape and the newest.

Router (`router/metrics.py`): requests = TTFT observations (each request's first token);
arrival rate = those plus the growth of the router's wait queue, per second; mean prompt and
output tokens per finished request (e2e observations); the share of prompt tokens the workers
reported cached; TTFT and ITL at the planner's quantile, from the histograms' window buckets.
Workers (their /metrics, found at `WorkerInfo.metrics_address`): the share of the window spent
in engine steps and the tokens generated per busy second; their registrations give role,
draining, running/waiting, queued prefill tokens, measured prefill rate and free blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.registration import WorkerInfo
from cluster.roles import Role
from local_cluster.metrics_text import Scrape, increase, quantile, window_buckets
from local_cluster.planner import Snapshot, WorkerLoad

ROUTER_TTFT = "pdserve_router_ttft_seconds"
ROUTER_ITL = "pdserve_router_itl_seconds"
ROUTER_E2E_COUNT = "pdserve_router_e2e_seconds_count"
ROUTER_PROMPT_TOKENS = "pdserve_router_prompt_tokens_total"
ROUTER_GENERATION_TOKENS = "pdserve_router_generation_tokens_total"
ROUTER_PREFIX_HITS = "pdserve_router_prefix_hit_tokens_total"
ROUTER_WAITING = "pdserve_router_waiting_requests"
WORKER_STEP_SECONDS = "pdserve_worker_engine_step_seconds_total"
WORKER_GENERATION_TOKENS = "pdserve_worker_generation_tokens_total"


@dataclass(frozen=True)
class Sample:
    """One round of scrapes at monotonic time `at`; a worker whose /metrics did not answer
    is missing from `workers`."""

    at: float
    router: Scrape
    workers: dict[str, Scrape]


class Window:
    """The scrapes of the last `window_s` seconds (plus the one just before, as the base)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)
        while len(self._samples) > 2 and sample.at - self._samples[1].at >= self.window_s:
            self._samples.popleft()

    def clear(self) -> None:
        """Forget the past (after a move: the next decision sees the new pools only)."""
        self._samples.clear()

    def snapshot(self, workers: list[WorkerInfo], quantile_q: float) -> Snapshot | None:
        """The window's Snapshot; None until the scrapes cover the window (90% of it: rounds
        drift by a few milliseconds), so a decision never rests on a few seconds of data."""
        if len(self._samples) < 2:
            return None
        old, new = self._samples[0], self._samples[-1]
        span = new.at - old.at
        if span <= 0 or span < 0.9 * self.window_s:
            return None
        return snapshot(old, new, span, workers, quantile_q)


def snapshot(
    old: Sample, new: Sample, span: float, workers: list[WorkerInfo], quantile_q: float
) -> Snapshot:
    r_old, r_new = old.router, new.router
    ttft = window_buckets(r_new, r_old, ROUTER_TTFT)
    itl = window_buckets(r_new, r_old, ROUTER_ITL)
    requests = int(ttft.get(float("inf"), 0.0))
    queue_growth = max(
        0.0, (r_new.value(ROUTER_WAITING) or 0.0) - (r_old.value(ROUTER_WAITING) or 0.0)
    )
    finished = increase(r_new, r_old, ROUTER_E2E_COUNT)
    prompt = increase(r_new, r_old, ROUTER_PROMPT_TOKENS)
    cached = increase(r_new, r_old, ROUTER_PREFIX_HITS, source="reported")
    generated = increase(r_new, r_old, ROUTER_GENERATION_TOKENS)
    return Snapshot(
        window_s=span,
        requests=requests,
        arrival_rate=(requests + queue_growth) / span,
        mean_prompt_tokens=prompt / finished if finished else 0.0,
        cached_fraction=min(1.0, cached / prompt) if prompt else 0.0,
        mean_output_tokens=generated / finished if finished else 0.0,
        ttft_s=quantile(ttft, quantile_q),
        itl_s=quantile(itl, quantile_q),
        workers=tuple(
            worker_load(w, old.workers.get(w.worker_id), new.workers.get(w.worker_id), span)
            for w in sorted(workers, key=lambda w: w.worker_id)
        ),
    )


def worker_load(
    info: WorkerInfo, old: Scrape | None, new: Scrape | None, span: float
) -> WorkerLoad:
    """A registration plus its window of /metrics (no busy figures without both scrapes)."""
    c = info.capacity
    busy_s = increase(new, old, WORKER_STEP_SECONDS) if new is not None and old is not None else 0.0
    tokens = (
        increase(new, old, WORKER_GENERATION_TOKENS) if new is not None and old is not None else 0.0
    )
    return WorkerLoad(
        worker_id=info.worker_id,
        role=Role(info.role),
        draining=info.draining,
        running=c.running,  # type: ignore[arg-type]
        waiting=c.waiting,
        queued_prefill_tokens=c.queued_prefill_tokens,
        prefill_tokens_per_s=c.prefill_tokens_per_s,
        busy=min(1.0, busy_s / span),
        tokens_per_busy_s=tokens / busy_s if busy_s > 0 else 0.0,
        kv_used=1.0 - c.free_blocks / c.total_blocks if c.total_blocks else 0.0,
    )
