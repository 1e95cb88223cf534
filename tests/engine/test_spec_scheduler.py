"""The scheduler's side of speculation, with hand-built drafts and verify results: k + 1
tokens counted against the budget, drafts cut to max_tokens / max_model_len / the budget,
rejected drafts rolled back (counters, slots, blocks) and never hashed."""

from engine_factories import fake_model_output, make_request, make_scheduler

from engine.core.scheduler_output import RunnerOutput
from engine.kv.block_hash import BlockHash
from engine.processing.tokens import SampledToken
from engine.spec_decode.proposer import Proposal
from engine.spec_decode.state import SpecState


def _decoding(scheduler, request, k=4):
    """Admit `request` with speculation (k drafts) and run its prompt: it is decoding.
    Others already decoding get a token in that step (no drafts proposed for them)."""
    request.spec = SpecState(k, adaptive=False)
    scheduler.add_request(request)
    output = _propose(scheduler.schedule(), [])
    scheduler.update_from_output(output, fake_model_output(output))
    assert request.num_output_tokens == 1


def _propose(output, drafts):
    """The step with `drafts` proposed for every speculating request."""
    return output.with_drafts([Proposal(list(drafts)) for _ in output.speculating])


def _verify(scheduler, output, drafts, kept):
    """Propose `drafts` for every speculating request, then apply a verify result that
    keeps tokens `kept`."""
    output = _propose(output, drafts)
    sampled = {r.request_id: [SampledToken(t) for t in kept] for r, _ in output.speculating}
    return scheduler.update_from_output(output, RunnerOutput(sampled))


def test_budget_counts_k_plus_one_and_drafts_shrink_to_fit():
    s = make_scheduler(max_num_batched_tokens=7, block_size=4)
    a, b = make_request(6, max_tokens=50), make_request(6, max_tokens=50)
    _decoding(s, a)
    _decoding(s, b)
    out = s.schedule()
    assert out.scheduled == [(a, 5), (b, 2)]  # 1 + 4, then 1 + the 1 draft the budget leaves
    assert out.speculating == [(a, 4), (b, 1)]
    assert out.num_batched_tokens == 7
    out = _propose(out, [])  # no drafts proposed: plain decodes
    assert out.scheduled == [(a, 1), (b, 1)]
    s.update_from_output(out, fake_model_output(out))
    # The slots kept for the drafts went back to the pool as the output was applied.
    assert len(a.block_tables[0]) == s.bm.blocks_for(a.num_tokens - 1)
    for r in (a, b):
        s.finish_request(r.request_id, r.status.FINISHED_ABORTED)


def test_drafts_never_overrun_max_tokens_or_max_model_len():
    s = make_scheduler(max_model_len=12, block_size=4)
    short = make_request(6, max_tokens=3)  # 1 out, 2 to go: at most 1 draft + 1
    _decoding(s, short)
    assert s.schedule().speculating == [(short, 1)]
    s2 = make_scheduler(max_model_len=10, block_size=4)
    edge = make_request(6, max_tokens=50)  # 7 tokens; positions up to 9: at most 2 drafts
    _decoding(s2, edge)
    assert s2.schedule().speculating == [(edge, 2)]
    s.finish_request(short.request_id, short.status.FINISHED_ABORTED)
    s2.finish_request(edge.request_id, edge.status.FINISHED_ABORTED)


def test_rejected_drafts_roll_back_counters_slots_and_hashes():
    s = make_scheduler(block_size=4)
    r = make_request(7, max_tokens=50)  # prompt 7 + 1 output = 8 tokens: two full blocks
    _decoding(s, r)
    free_before = s.bm.pool.num_free_blocks
    out = s.schedule()  # 1 + 4 positions (7..11): a third block
    assert out.speculating == [(r, 4)] and s.bm.pool.num_free_blocks == free_before - 1
    # drafts 11, 12, 13, 14; the target accepts 11, then corrects with 20
    updated, finished = _verify(s, out, [11, 12, 13, 14], [11, 20])
    assert updated == [(r, 2)] and not finished
    assert r.output_token_ids[-2:] == [11, 20]
    assert r.num_computed_tokens == r.num_tokens - 1 == 9  # positions 7 (last) and 8 (11)
    assert len(r.block_tables[0]) == 3 and s.bm.pool.num_free_blocks == free_before - 1
    hashed = [s.bm.pool.blocks[b].block_hash for b in r.block_tables[0]]
    assert all(isinstance(h, BlockHash) for h in hashed[:2]) and hashed[2] is None
    assert s.spec_stats.num_draft_tokens == 4 and s.spec_stats.accepted_per_pos == [1, 0, 0, 0]
    # All rejected: the third block is still needed (position 10 is the next input).
    out = s.schedule()
    _verify(s, out, [1, 2, 3, 4], [5])
    assert r.num_computed_tokens == 10 and len(r.block_tables[0]) == 3
    s.finish_request(r.request_id, r.status.FINISHED_ABORTED)
    assert s.bm.pool.num_free_blocks == s.bm.pool.num_blocks


def test_a_stop_inside_the_accepted_run_drops_the_rest():
    s = make_scheduler(block_size=4)
    r = make_request(6, max_tokens=50)
    _decoding(s, r)
    out = s.schedule()
    _, finished = _verify(s, out, [9, 2, 9, 9], [9, 2, 9, 9, 9])  # 2 is EOS
    assert finished == [r] and r.output_token_ids[-2:] == [9, 2]
    assert r.status.finish_reason == "stop" and s.bm.pool.num_free_blocks == s.bm.pool.num_blocks


def test_short_of_blocks_drafts_go_before_anyone_is_preempted():
    s = make_scheduler(num_blocks=2, block_size=4)
    r = make_request(6, max_tokens=50)  # 7 tokens in 2 blocks; drafts would need a third
    _decoding(s, r)
    out = s.schedule()
    assert out.scheduled == [(r, 1)] and not out.speculating and not out.preempted
    s.update_from_output(out, fake_model_output(out))
    assert not r.status.is_finished
    s.finish_request(r.request_id, r.status.FINISHED_ABORTED)
