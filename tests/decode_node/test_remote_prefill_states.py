"""The remote-prefill state machine: its transition table, idempotence, illegal moves."""

import pytest

from decode_node.remote_prefill import _NEXT, IllegalTransition, RemotePrefill, RemoteState

S = RemoteState


def _at(state):
    attempt = RemotePrefill("r", "r:0", [1, 2], done=None)
    attempt.state = state
    return attempt


def test_terminal_states_lead_nowhere_and_every_state_is_reachable():
    assert _NEXT[S.RUNNING] == _NEXT[S.RELEASED] == frozenset()
    reachable = {S.PARKED}
    for targets in _NEXT.values():
        reachable |= targets
    assert reachable == set(S)
    assert [s for s in S if s.live] == [S.PARKED, S.KV_LANDED, S.FIRST_TOKEN]


@pytest.mark.parametrize("state", list(S))
def test_moving_to_the_current_state_is_a_no_op(state):
    attempt = _at(state)
    assert attempt.advance(state) is False and attempt.state is state


@pytest.mark.parametrize("src,dst", [(a, b) for a in S for b in S if a is not b])
def test_only_the_tables_transitions_are_allowed(src, dst):
    attempt = _at(src)
    if dst in _NEXT[src]:
        assert attempt.advance(dst) is True and attempt.state is dst
    else:
        with pytest.raises(IllegalTransition):
            attempt.advance(dst)
        assert attempt.state is src


def test_blocks_are_released_only_once_p_has_stopped():
    # Leaving a state where P may still write straight to RELEASED needs P's word: only
    # FIRST_TOKEN (P answered) and QUARANTINED (by `writes_stopped`) reach RELEASED that way.
    assert not S.PARKED.p_stopped and not S.KV_LANDED.p_stopped and not S.QUARANTINED.p_stopped
    assert S.FIRST_TOKEN.p_stopped and S.FIRST_TOKEN not in _NEXT[S.QUARANTINED]
