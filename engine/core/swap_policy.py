"""Swap or recompute a preempted request's partial last block, by measured costs.

A preempted request's full blocks stay cached under their hashes (and are demoted to the
KV tier when evicted); what a preemption would otherwise lose is its partial last block:
the `partial` computed tokens past its last full block, recomputed when it resumes. Swapping
them instead costs one copy out and one copy back per KV group. The scheduler asks
`SwapPolicy.swap` at each preemption; the rates are the worker's own, measured as it runs:
the tier's seconds per block copy (`KVTier.copy_times`: measured once when the engine is
built, then by every flush) and the engine's seconds per computed token in steps that
computed prompt tokens (`observe_prefill`, fed by `Scheduler.update_from_output` from
`RunnerOutput.seconds`, the runner's own time for the step).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.kv_tier import CopyTimes

PREFILL_EWMA_WEIGHT = 0.2  # weight of the newest prefill step in the per-token mean


@dataclass
class SwapPolicy:
    copy_times: CopyTimes | None = None
    """The tier's measured copy times (None: no tier, never swap)."""
    prefill_s_per_token: float = 0.0
    """Seconds per token of recent steps that computed prompt tokens (the runner's wall time /
    tokens computed; 0.0 until measured). Counting the step's fixed cost as per-token cost
    leans towards swapping, which costs no forward; on CUDA a step that samples nothing may
    return before its kernels finish, which leans towards recomputing."""
    _warm: bool = False  # the first prefill step (first forwards allocate) is not counted

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """A step that computed prompt tokens took `seconds` for `tokens` tokens in all."""
        if not self._warm:
            self._warm = True
            return
        per = seconds / tokens
        old = self.prefill_s_per_token
        self.prefill_s_per_token = per if old == 0.0 else old + PREFILL_EWMA_WEIGHT * (per - old)

    def swap(self, partial: int, num_groups: int) -> bool:
        """Swap `partial` computed tokens (one block per group) rather than recompute them:
        True when copying the blocks out and back is measured to be faster than computing
        the tokens. Conservative while either rate is unmeasured: recompute (what an engine
        without a tier does; it costs nothing until the request resumes)."""
        times = self.copy_times
        if (
            times is None
            or partial <= 0
            or not (times.store_s and times.load_s and self.prefill_s_per_token)
        ):
            return False
        return num_groups * (times.store_s + times.load_s) < partial * self.prefill_s_per_token
