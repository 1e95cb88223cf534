"""The per-sequence speculation policy: full k after one fully accepted step, few failed
drafts when nothing is ever accepted, k shaped by the acceptance estimate."""

from engine.spec_decode.state import SpecState


def _run(state: SpecState, steps: int, accept) -> tuple[int, int]:
    """Drive `steps` scheduling steps; `accept(k)` says how many of k drafts are kept.
    Returns (drafts proposed, verify steps)."""
    proposed = verifies = 0
    for _ in range(steps):
        k = state.allowance()
        if k:
            state.record(k, accept(k))
            proposed, verifies = proposed + k, verifies + 1
    return proposed, verifies


def test_drafts_that_are_always_accepted_reach_the_full_k_at_once():
    s = SpecState(max_k=4)
    assert s.allowance() == 2  # a new sequence starts cautiously
    s.record(2, 2)
    assert s.allowance() == 4


def test_drafts_that_are_never_accepted_cost_about_log2_steps():
    proposed, verifies = _run(SpecState(max_k=4), 1000, lambda k: 0)
    assert verifies <= 12 and proposed <= 14  # 2 + 1 at the start, then one probe per cool-down


def test_without_adaptation_every_step_drafts_k():
    assert _run(SpecState(max_k=3, adaptive=False), 50, lambda k: 0) == (150, 50)


def test_k_follows_the_acceptance_estimate():
    s = SpecState(max_k=8)
    for p, k in ((0.9, 8), (0.6, 3), (0.4, 2), (0.25, 1)):
        s.acceptance = p
        assert s.allowance() == k, p
