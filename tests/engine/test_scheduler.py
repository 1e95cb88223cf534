import random

import pytest
from engine_factories import drain, make_request, make_requests, make_scheduler, step

from engine.core.limits import RequestRejected
from engine.core.request import RequestStatus
from engine.core.scheduler_output import RunnerOutput
from engine.processing.tokens import SampledToken


def test_token_budget_and_max_num_seqs_are_never_exceeded():
    rng = random.Random(0)
    s = make_scheduler(num_blocks=200, max_num_batched_tokens=32, max_num_seqs=6)
    for r in make_requests([rng.randint(1, 90) for _ in range(20)], max_tokens=5):
        s.add_request(r)
    while s.has_unfinished():
        out = step(s)
        assert 0 < out.num_batched_tokens <= 32
        assert len(s.running) <= 6
    assert s.bm.pool.num_free_blocks == 200


def test_long_prompts_are_chunked():
    s = make_scheduler(max_num_batched_tokens=16)
    r = make_request(50)
    s.add_request(r)
    chunks = []
    while r.num_output_tokens == 0:
        out = step(s)
        chunks.append(out.scheduled[0][1])
    assert chunks == [16, 16, 16, 2]
    drain(s)


def test_chunked_prefill_off_waits_for_a_budget_that_fits_whole():
    s = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(RequestRejected, match="max_num_batched_tokens"):
        s.add_request(make_request(17))
    a, b = make_request(10), make_request(10)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()  # b does not fit the remaining 6 tokens and is not chunked
    assert [(r.request_id, n) for r, n in out.scheduled] == [(a.request_id, 10)]
    s.update_from_output(out, RunnerOutput({a.request_id: [SampledToken(7)]}))
    drain(s)


def test_every_running_decode_progresses_every_step():
    s = make_scheduler(max_num_batched_tokens=64)
    reqs = make_requests([5, 9, 13], max_tokens=6)
    for r in reqs:
        s.add_request(r)
    step(s)  # all three prefill in one step
    while s.running:
        before = {r.request_id: r.num_output_tokens for r in s.running}
        out = step(s)
        assert {r.request_id for r, _ in out.scheduled} == set(before)
        for r in reqs:
            if r.request_id in before:
                assert r.num_output_tokens == before[r.request_id] + 1
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6 for r in reqs)


def test_prefill_chunks_and_decodes_share_a_step():
    s = make_scheduler(max_num_batched_tokens=10)
    short, long = make_request(4, max_tokens=20), make_request(40)
    s.add_request(short)
    step(s)
    s.add_request(long)
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [
        (short.request_id, 1),
        (long.request_id, 9),
    ]
    drain(s)


def test_preemption_newest_first_and_resumption_under_a_tiny_pool():
    # 3 requests of 8 prompt tokens + 12 outputs need 5 blocks each; the pool has 10.
    s = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    reqs = make_requests([8, 8, 8], max_tokens=12)
    for r in reqs:
        s.add_request(r)
    saw_preemption = False
    while s.has_unfinished():
        out = step(s)
        if out.preempted:
            saw_preemption = True
            running_arrivals = [r.arrival_time for r in s.running]
            for victim in out.preempted:  # the victim is newer than everyone still running
                assert all(victim.arrival_time >= t for t in running_arrivals)
                assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert saw_preemption and s.stats.num_preemptions > 0
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert s.bm.pool.num_free_blocks == 10


def test_impossible_requests_are_rejected_not_queued():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="maximum context length"):
        s.add_request(make_request(64))
    with pytest.raises(RequestRejected, match="whole pool"):
        s.add_request(make_request(20))  # 21 tokens need 6 blocks > 4
    with pytest.raises(RequestRejected, match="empty"):
        s.add_request(make_request([]))
    assert not s.has_unfinished()


def test_output_stops_at_eos_unless_ignored_and_at_max_model_len():
    s = make_scheduler(max_model_len=12)
    r = make_request(4, max_tokens=100)
    s.add_request(r)
    step(s, token=2)  # eos
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [2]
    r2 = make_request(4, max_tokens=100)
    s.add_request(r2)
    drain(s)
    assert r2.status is RequestStatus.FINISHED_LENGTH and r2.num_tokens == 12


def test_prefix_hits_skip_computation():
    s = make_scheduler(max_num_batched_tokens=64)
    first = make_request(17)
    s.add_request(first)
    drain(s)
    second = make_request(17)
    s.add_request(second)
    out = step(s)
    assert out.scheduled[0][1] == 1 and second.num_cached_tokens == 16
    drain(s)


def test_fork_for_n_completions_shares_the_prompt_blocks():
    s = make_scheduler(max_num_batched_tokens=64)
    r = make_request(6, n=3, max_tokens=4)
    s.add_request(r)
    step(s)
    group = [x for x in s.running]
    assert sorted(x.completion_index for x in group) == [0, 1, 2]
    first_blocks = {s.bm.block_table(x.request_id)[0] for x in group}
    assert len(first_blocks) == 1 and s.bm.pool.blocks[first_blocks.pop()].ref_count == 3
    out = s.schedule()
    assert len(out.block_copies) == 2  # two of three diverge from the shared partial block
    s.update_from_output(
        out, RunnerOutput({x.request_id: [SampledToken(7)] for x, _ in out.scheduled})
    )
    drain(s)
    assert all(x.num_output_tokens == 4 for x in group)


def test_waiting_for_kv_transition_by_hand():
    s = make_scheduler(num_blocks=16, block_size=4)
    warm = make_request(9)
    s.add_request(warm)
    drain(s)  # blocks of the first 8 tokens are now cached locally
    r = make_request(9)
    needed = s.allocate_for_remote_kv(r)
    assert r.status is RequestStatus.WAITING_FOR_KV and r.num_computed_tokens == 0
    assert needed == s.bm.block_table(r.request_id)[2:]  # only the block after the local hit
    out = s.schedule()
    assert out.scheduled == []  # parked: nothing to compute until the KV arrives
    s.remote_kv_arrived(r.request_id, SampledToken(42))
    assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == 9
    assert r.output_token_ids == [42]
    out = step(s)
    assert out.scheduled == [(r, 1)]
    drain(s)


def test_remote_kv_allocation_failure_changes_nothing():
    s = make_scheduler(num_blocks=2, block_size=4)
    hog = make_request(4)
    s.add_request(hog)
    step(s)
    r = make_request(list(range(300, 306)))  # no prefix in common with hog
    assert s.allocate_for_remote_kv(r) is None
    assert r.request_id not in s.requests and s.bm.pool.num_free_blocks == 1
    drain(s)


def test_abort_in_any_state_frees_everything():
    s = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    running, waiting, parked = make_request(6), make_request(30), make_request(5)
    s.add_request(running)
    step(s)
    s.add_request(waiting)
    s.allocate_for_remote_kv(parked)
    step(s)  # waiting is now mid-prefill
    for r in (running, waiting, parked):
        s.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
        assert r.status is RequestStatus.FINISHED_ABORTED
    assert s.finish_request(running.request_id, RequestStatus.FINISHED_ABORTED) is None
    assert not s.has_unfinished() and s.bm.pool.num_free_blocks == 16


def test_a_sequence_that_outgrows_the_whole_pool_stops_with_length():
    s = make_scheduler(num_blocks=2, block_size=4)
    r = make_request(4, max_tokens=50)
    s.add_request(r)
    drain(s)
    # 8 slots: the 9th token is sampled from the 8th position and needs no slot of its own.
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 9


def test_waiting_requests_run_in_priority_then_arrival_order():
    s = make_scheduler(max_num_seqs=1)
    low, high, high_later = (
        make_request(4, priority=1),
        make_request(4, priority=0),
        make_request(4, priority=0),
    )
    for r in (low, high, high_later):
        s.add_request(r)
    order = []
    while s.has_unfinished():
        out = step(s)
        order += [r for r, _ in out.scheduled if r not in order]
    assert order == [high, high_later, low]


def test_preemption_picks_the_lowest_priority_running_request_and_requeues_it_in_order():
    # Two requests of 8 prompt + 12 outputs need 5 blocks each; the pool has 8.
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    background = make_request(8, max_tokens=12, priority=5)  # older but less important
    urgent = make_request(8, max_tokens=12, priority=-1)
    s.add_request(background)
    step(s)
    s.add_request(urgent)
    victims = []
    while s.has_unfinished():
        out = step(s)
        victims += out.preempted
        assert s.waiting == sorted(s.waiting, key=lambda r: (r.priority, r.arrival_time))
    assert victims and all(v is background for v in victims)
    assert urgent.num_output_tokens == background.num_output_tokens == 12


def test_remote_kv_admission_respects_max_num_seqs():
    s = make_scheduler(num_blocks=64, max_num_seqs=2)
    running = make_request(5)
    s.add_request(running)
    step(s)
    parked = make_request(list(range(300, 306)))
    assert s.allocate_for_remote_kv(parked) is not None
    extra = make_request(list(range(400, 406)))
    free_before = s.bm.pool.num_free_blocks
    assert s.allocate_for_remote_kv(extra) is None  # running + parked == max_num_seqs
    assert extra.request_id not in s.requests and s.bm.pool.num_free_blocks == free_before
    s.remote_kv_arrived(parked.request_id, SampledToken(7))
    drain(s)
    assert s.allocate_for_remote_kv(extra) is not None  # room again
    s.remote_kv_arrived(extra.request_id, SampledToken(7))
    drain(s)


def test_requests_that_left_are_named_once_in_the_next_output():
    """Finished (by the stop rules, an abort, or while waiting) requests are handed to the
    runner once, in the next SchedulerOutput, so it drops what it keeps for them."""
    s = make_scheduler()
    done, aborted, waiting = make_request(4, max_tokens=1), make_request(4), make_request(4)
    s.add_request(done)
    s.add_request(aborted)
    step(s)  # `done` samples its one token and finishes
    s.finish_request(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    s.add_request(waiting)
    s.finish_request(waiting.request_id, RequestStatus.FINISHED_ABORTED)
    assert s.finish_request(waiting.request_id, RequestStatus.FINISHED_ABORTED) is None
    out = s.schedule()
    assert out.finished_req_ids == [done.request_id, aborted.request_id, waiting.request_id]
    assert s.schedule().finished_req_ids == []
