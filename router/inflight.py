"""A router's own load on the workers of one call, counted while the call runs (see
`InFlight`). Used by router/dispatch.py around every Generate call."""
from __future__ import annotations

from router.metrics import RouterMetrics
from router.placement import Placement
from router.registry import WorkerRegistry, WorkerState


class InFlight:
    """This router's own load on a placement's workers while its call runs, so back-to-back
    placements see it before the workers' next capacity report: the decode worker's request
    count (and the running gauge) until the end; the prefill worker's share of the prompt
    until the first token, or the end if none came. Leaving, however the call ended
    (cancellation included), wakes the requests waiting for capacity."""

    __slots__ = ("decode", "prefill", "prefill_work", "metrics", "registry")

    def __init__(self, placement: Placement, num_prompt: int, metrics: RouterMetrics,
                 registry: WorkerRegistry) -> None:
        self.decode: WorkerState = placement.decode
        self.prefill: WorkerState | None = placement.prefill  # None once its part is done
        # The prefill worker's extra work: the part of the prompt it does not hold.
        self.prefill_work = num_prompt - (
            placement.decision.prefill.cached_tokens if self.prefill is not None else 0)
        self.metrics = metrics
        self.registry = registry

    def __enter__(self) -> InFlight:
        self.decode.inflight += 1
        if self.prefill is not None:
            self.prefill.inflight_prefill_tokens += self.prefill_work
        self.metrics.running.inc()
        return self

    def first_token(self) -> None:
        """The prefill worker's part is done (later calls do nothing)."""
        if self.prefill is not None:
            self.prefill.inflight_prefill_tokens -= self.prefill_work
            self.prefill = None

    def __exit__(self, *exc_info: object) -> None:
        self.decode.inflight -= 1
        self.first_token()
        self.metrics.running.dec()
        self.registry.notify()
