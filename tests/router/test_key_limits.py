"""The per-key limits' slots and token buckets (router/http/key_limits.py) on a fake clock: slots
taken and freed, the bucket's refill, the Retry-After of a refusal, the reconciliation of a
reservation with what a request used, a request larger than a minute's budget (a debt), and
refusals that take nothing."""

import pytest

from router.http.errors import APIError
from router.http.key_limits import KeyLimits, LimitReason

A, B = b"a" * 32, b"b" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limits(concurrent: int = 0, per_minute: int = 0) -> tuple[KeyLimits, Clock, list]:
    clock, refused = Clock(), []
    return KeyLimits(concurrent, per_minute, clock, refused.append), clock, refused


def refusal(call, *args) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args)
    err = info.value
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.body()["error"]["type"] == "rate_limit_error"
    return err


def test_off_or_without_a_tenant_nothing_is_limited():
    lim, _, _ = limits()
    assert not lim.enabled and lim.admit(A) is None
    lim, _, _ = limits(1, 100)
    for _ in range(3):
        ticket = lim.admit(None)  # an admin key, or no key
        assert ticket is None
        lim.reserve(ticket, 10**6, 10**6)
        lim.release(ticket)


def test_concurrency_slots_per_key():
    lim, _, refused = limits(concurrent=2)
    a1, a2 = lim.admit(A), lim.admit(A)
    err = refusal(lim.admit, A)
    assert (
        err.headers == {"Retry-After": "1"} and "--max-concurrent-requests-per-key" in err.message
    )
    assert refused == [LimitReason.CONCURRENCY]
    assert lim.in_flight(A) == 2  # the refused one took no slot
    b = lim.admit(B)  # another key is not affected
    lim.release(a1)
    lim.release(a1)  # idempotent
    assert lim.in_flight(A) == 1
    a3 = lim.admit(A)
    for t in (a2, a3, b):
        lim.release(t)
    assert (lim.in_flight(A), lim.in_flight(B)) == (0, 0)


def test_token_bucket_refill_and_retry_after():
    lim, clock, refused = limits(per_minute=600)  # 10 tokens/s
    t = lim.admit(A)
    lim.reserve(t, 100, 400)  # 500 of 600
    assert lim.available(A) == 100
    t2 = lim.admit(A)
    err = refusal(lim.reserve, t2, 50, 100)  # needs 150: 50 short = 5 s
    assert err.headers == {"Retry-After": "5"} and refused == [LimitReason.TOKENS]
    assert "150 tokens" in err.message and "--max-tokens-per-minute-per-key" in err.message
    assert lim.available(A) == 100  # the refusal took nothing
    clock.now += 4.2
    assert refusal(lim.reserve, t2, 50, 100).headers == {"Retry-After": "1"}  # 0.8 s: rounded up
    clock.now += 0.8
    lim.reserve(t2, 50, 100)
    assert lim.available(A) == 0
    clock.now += 3600
    assert lim.available(A) == 600  # never above a minute's tokens
    assert lim.available(B) == 600  # every key has its own bucket


def test_reconciliation_gives_back_what_was_not_generated():
    lim, clock, _ = limits(per_minute=600)
    t = lim.admit(A)
    lim.reserve(t, 100, 400)
    assert t.used == 100  # the prompt is spent
    t.generated += 30  # 30 tokens generated (of max_tokens 400)
    lim.release(t)
    assert lim.available(A) == 600 - 130
    lim.release(t)  # idempotent: given back once
    assert lim.available(A) == 470


def test_a_request_failed_by_the_cluster_before_a_token_is_not_charged():
    lim, _, _ = limits(per_minute=600)
    t = lim.admit(A)
    lim.reserve(t, 100, 400)
    lim.release(t, served=False)  # e.g. a 503: no worker had room
    assert lim.available(A) == 600
    t = lim.admit(A)
    lim.reserve(t, 100, 400)
    t.generated += 7
    lim.release(t, served=False)  # failed after tokens: what it used is charged
    assert lim.available(A) == 600 - 107


def test_an_empty_bucket_refuses_before_the_body_is_read():
    lim, clock, refused = limits(concurrent=5, per_minute=60)  # 1 token/s
    t = lim.admit(A)
    lim.reserve(t, 60, 0)
    lim.release(t)
    err = refusal(lim.admit, A)
    assert err.headers == {"Retry-After": "1"} and refused == [LimitReason.TOKENS]
    assert lim.in_flight(A) == 0
    clock.now += 1
    lim.release(lim.admit(A))


def test_a_request_larger_than_a_minute_overdraws_a_full_bucket():
    lim, clock, _ = limits(per_minute=600)
    t = lim.admit(A)
    lim.reserve(t, 100, 200)
    t2 = lim.admit(A)
    err = refusal(lim.reserve, t2, 1000, 1000)  # a full bucket needed: 300 short = 30 s
    assert err.headers == {"Retry-After": "30"}
    t.generated += 200
    lim.release(t)  # all of its reservation used
    clock.now += 30
    lim.reserve(t2, 1000, 1000)  # takes the whole bucket
    assert lim.available(A) == 0
    t2.generated += 500  # 1500 used: 900 more than the 600 taken
    lim.release(t2)
    assert lim.available(A) == -900  # a debt: 90 s before the next request
    err = refusal(lim.admit, A)
    assert err.headers == {"Retry-After": "91"}  # until the bucket holds 1 token
    clock.now += 91
    lim.release(lim.admit(A))


def test_refused_for_tokens_frees_its_slot_on_release():
    lim, _, _ = limits(concurrent=2, per_minute=100)
    lim.reserve(lim.admit(A), 50, 0)
    t = lim.admit(A)
    refusal(lim.reserve, t, 40, 20)
    lim.release(t)  # what the middleware does after the 429 response
    assert lim.in_flight(A) == 1 and lim.available(A) == 50


def test_negative_limits_are_refused():
    with pytest.raises(ValueError):
        KeyLimits(-1, 0)


def test_compile_seconds_are_counted_and_their_bucket_refills():
    clock, refused = Clock(), []
    lim = KeyLimits(0, 0, clock, refused.append, compile_seconds_per_minute=6)
    lim.may_compile(A)  # a full bucket: 6 s
    lim.charge_compile(A, 4.0)
    lim.may_compile(A)  # 2 s left
    lim.charge_compile(A, 5.0)  # a compile may overdraw it: 3 s of debt
    err = refusal(lim.may_compile, A)
    assert "--max-compile-seconds-per-minute-per-key" in err.message
    assert err.headers["Retry-After"] == "31"  # 3 s of debt at 0.1 s per second, then positive
    assert refused == [LimitReason.COMPILE_SECONDS]
    lim.may_compile(B)  # another key: its own bucket
    lim.may_compile(None)  # keyless: counted, never limited
    lim.charge_compile(None, 50.0)
    lim.may_compile(None)
    clock.now += 31
    lim.may_compile(A)
    assert (lim.compile_seconds(A), lim.compile_seconds(B), lim.compile_seconds(None)) == (
        9.0,
        0.0,
        50.0,
    )
    off = KeyLimits(0, 0, clock)  # no budget: the seconds are still counted, nothing refused
    off.charge_compile(A, 100.0)
    off.may_compile(A)
    assert off.compile_seconds(A) == 100.0
