"""A router's own load on the workers of one call, counted while the call runs (see
`InFlight`). Used by router/dispatch.py around every Generate call."""

from __future__ import annotations

from router.metrics import RouterMetrics
from router.placement.placer import Placement
from router.placement.registry import WorkerRegistry, WorkerState


class InFlight:
    """This router's own load on a placement's workers while its call runs, so back-to-back
    placements see it before the workers' next capacity report: the decode worker's request
    count (and the running gauge) until the end; the prompt's uncached part as prefill work
    on the worker that computes it (the prefill worker, or the decode worker prefilling
    locally) until the first token, or the end if none came. Leaving, however the call ended
    (cancellation included), wakes the requests waiting for capacity."""

    __slots__ = ("decode", "prefill", "prefill_work", "metrics", "registry")

    def __init__(
        self,
        placement: Placement,
        num_prompt: int,
        metrics: RouterMetrics,
        registry: WorkerRegistry,
    ) -> None:
        self.decode: WorkerState = placement.decode
        decision = placement.decision
        # Who computes the prompt; None once its part is done.
        self.prefill: WorkerState | None = placement.prefill or placement.decode
        # Its extra work: the part of the prompt it does not hold.
        self.prefill_work = num_prompt - (decision.prefill or decision.decode).cached_tokens
        self.metrics = metrics
        self.registry = registry

    def __enter__(self) -> InFlight:
        self.decode.inflight += 1
        if self.prefill is not None:
            self.prefill.inflight_prefill_tokens += self.prefill_work
        self.metrics.running.inc()
        return self

    def first_token(self) -> None:
        """The prompt's computation is done (later calls do nothing)."""
        if self.prefill is not None:
            self.prefill.inflight_prefill_tokens -= self.prefill_work
            self.prefill = None

    def __exit__(self, *exc_info: object) -> None:
        self.decode.inflight -= 1
        self.first_token()
        self.metrics.running.dec()
        self.registry.notify()
