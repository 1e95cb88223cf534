"""Per-API-key limits: how many requests one key may have in flight, and how many tokens it
may spend per minute, and how many seconds of grammar compiles, so that one tenant cannot take
the whole cluster (docs/router.md, "Limits"; the flags are LimitsConfig's
`max_concurrent_requests_per_key`, `max_tokens_per_minute_per_key` and
`max_compile_seconds_per_minute_per_key`, 0 = off).

Who is limited: the holder of an inference key, on the paths that run on workers or tokenize
its text (`LIMITED_PATHS`), and in the endpoint picker's decisions. Tenants are told apart by
the sha256 digest of their key (router/http/auth.py puts it in the ASGI scope as `TENANT`); no
key is held here, and no metric names a tenant. A request without a tenant is not limited:
one that presented an admin key, or any request of a router without API keys
(auth.resolve_keys refuses these flags without keys at start).

Life cycle of a request here:
1. `admit` (router/http/middleware.py, before the body is read): a concurrency slot, or 429
   (reason concurrency, `Retry-After: 1`: a slot frees when one of the key's requests ends),
   or 429 (reason tokens) if the key's token bucket is empty or in debt. The slot's `Ticket`
   goes in the scope (`TICKET`).
2. `reserve` (the handler, once the request is tokenized, just before it is dispatched): the
   prompt tokens + the completion tokens it may generate (max_tokens x n; no max_tokens: what
   the context leaves) are taken from the key's token bucket, or 429 (reason tokens,
   `Retry-After` = the seconds until the bucket holds them). A request larger than a whole
   minute's budget waits for a full bucket and takes all of it (it is never refused for its
   size alone); its excess is charged at the end, as a debt.
3. The handler counts the tokens generated into the ticket (`Ticket.generated`).
4. `release` (the middleware, when the response has been sent: a stream ended, the client
   left, or an error): the slot is freed and the bucket is reconciled: what was reserved
   but not used (prompt + tokens generated) is given back, what was used beyond the
   reservation is taken (the bucket may go negative; later requests wait until it refills).
   A request that failed on the router's side (a 5xx: no worker had room, workers failed)
   before any token is charged nothing; one whose client left is charged its prompt + the
   tokens generated until then (the prompt may well have been prefilled).
A request refused at 1 or 2, or by anything before 2 (a 400, a 401), spends no tokens and
holds no slot once its response is sent.

Why reserve max_tokens up front rather than charge tokens as they are generated: otherwise a
key could start any number of long generations on a full bucket at once and pay afterwards;
reserving makes what runs concurrently fit the budget, and the reconciliation keeps the
charge honest (OpenAI's rate limits also count max_tokens at admission).

Grammar compiles are charged too (router/generation/structured.py `Grammars.check`): the
seconds each structured-output compile took (its process's compile time; one killed at the
time limit: the whole limit) go into the key's compile-seconds account (`compile_seconds`),
and, with `max_compile_seconds_per_minute_per_key`, are taken from a second bucket that works
as the tokens' does (one minute's seconds at most, refilled continuously, a compile that
overran it leaves a debt). Before a compile (a cache miss: a cached constraint costs nothing)
`may_compile` refuses with 429 (reason compile_seconds, Retry-After = the seconds until the
bucket is positive again) a key whose bucket is empty or in debt: a key that burns compile
time is throttled as one that burns tokens. Requests without a key (a keyless router, an
admin key) are counted as one tenant (`KEYLESS`) and not limited.

The counts live in this router process: N router replicas allow a key N times the limits.

The bucket holds at most one minute's tokens and refills continuously (rate / 60 per
second); it starts full. So a key spends at most the rate per minute in the long run, plus a
burst of one minute's budget.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import Callable

from router.http.errors import APIError

TENANT = "pdserve.tenant"
"""The ASGI scope entry router/http/auth.py sets to the digest of the inference key presented."""
TICKET = "pdserve.key_ticket"
"""The ASGI scope entry holding a limited request's `Ticket` (set by `admit`'s caller)."""
LIMITED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
    }
)
"""The paths limited per key: those whose requests run on workers, and those that spend the
router's CPU on a key's text (tokenizing). The endpoint picker takes a slot for the time of
its decision (router/endpoint_picker/picker.py)."""
KEYLESS = b""
"""The one tenant requests without an inference key count as (compile accounting, turns at
the compile processes); never limited. A key's digest is 32 bytes: no key is this."""


class LimitReason(str, enum.Enum):
    """Why a request was refused (the `reason` label of the rate-limited counter)."""

    CONCURRENCY = "concurrency"
    TOKENS = "tokens"
    COMPILE_SECONDS = "compile_seconds"


@dataclass(slots=True)
class Ticket:
    """One admitted request of a limited key: its slot, and its tokens."""

    tenant: bytes
    reserved: int = 0
    """Tokens taken from the bucket by `reserve`."""
    prompt: int = 0
    """Its prompt tokens (set by `reserve`)."""
    generated: int = 0
    """Tokens generated so far (added by the handler as they arrive)."""
    released: bool = False

    @property
    def used(self) -> int:
        return self.prompt + self.generated


@dataclass(slots=True)
class _Tenant:
    in_flight: int
    level: float  # tokens in the bucket; negative: a debt
    stamp: float  # clock time `level` and `compile_level` were computed at
    compile_level: float = 0.0  # compile seconds in the bucket; negative: a debt
    compiled_s: float = 0.0  # compile seconds charged so far (all time)


class KeyLimits:
    """The per-key concurrency slots and token buckets of one router (all on its event
    loop: no locking). `clock` is monotonic seconds (tests inject a fake); `on_refused` is
    told each refusal's reason (the metric)."""

    def __init__(
        self,
        max_concurrent: int,
        tokens_per_minute: int,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[LimitReason], None] = lambda reason: None,
        compile_seconds_per_minute: float = 0.0,
    ) -> None:
        if max_concurrent < 0 or tokens_per_minute < 0 or compile_seconds_per_minute < 0:
            raise ValueError("per-key limits must be >= 0 (0: off)")
        self.max_concurrent = max_concurrent
        self.tokens_per_minute = tokens_per_minute
        self.compile_seconds_per_minute = compile_seconds_per_minute
        self.clock = clock
        self.on_refused = on_refused
        self._tenants: dict[bytes, _Tenant] = {}  # one per key seen (keys are configured: bounded)

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0 or self.tokens_per_minute > 0

    def admit(self, tenant: bytes | None) -> Ticket | None:
        """A slot for one request of `tenant` (None: not limited), or a 429 APIError."""
        if tenant is None or not self.enabled:
            return None
        state = self._state(tenant)
        if self.max_concurrent and state.in_flight >= self.max_concurrent:
            raise self._refuse(
                LimitReason.CONCURRENCY,
                1,
                f"This API key has {state.in_flight} requests in progress, the "
                f"most this server allows one key "
                f"(--max-concurrent-requests-per-key); retry when one ends.",
            )
        if self.tokens_per_minute:  # in debt or empty: refused before its body is read
            self._refill(state)
            if state.level < 1:
                raise self._tokens_refused(state, 1, "This API key has no tokens left")
        state.in_flight += 1
        return Ticket(tenant)

    def reserve(self, ticket: Ticket | None, prompt_tokens: int, completion_tokens: int) -> None:
        """Take a request's tokens from its key's bucket, or raise a 429 APIError (nothing
        taken). `completion_tokens`: the most it may generate. Once per ticket."""
        if ticket is None:
            return
        if self.tokens_per_minute:
            state = self._refill(self._state(ticket.tenant))
            cost = prompt_tokens + completion_tokens
            take = min(cost, self.tokens_per_minute)  # larger: a full bucket, the rest as debt
            if state.level < take:
                raise self._tokens_refused(
                    state,
                    take,
                    f"This request needs {cost} tokens ({prompt_tokens} prompt + "
                    f"{completion_tokens} completion at most); this API key has "
                    f"{max(0, int(state.level))} left",
                )
            state.level -= take
            ticket.reserved = take
        ticket.prompt = prompt_tokens

    def release(self, ticket: Ticket | None, served: bool = True) -> None:
        """The request is over: free its slot and reconcile its tokens (idempotent).
        `served` False (the router or the cluster failed it: a 5xx) with no token generated:
        nothing is charged."""
        if ticket is None or ticket.released:
            return
        ticket.released = True
        state = self._refill(self._state(ticket.tenant))
        state.in_flight -= 1
        if self.tokens_per_minute:
            used = ticket.used if served or ticket.generated else 0
            state.level = min(self.tokens_per_minute, state.level + ticket.reserved - used)

    def may_compile(self, tenant: bytes | None) -> None:
        """Before a compile of `tenant`'s (None: keyless, never limited): a 429 APIError if
        its compile-seconds bucket is empty or in debt."""
        rate = self.compile_seconds_per_minute
        if tenant is None or not rate:
            return
        state = self._refill(self._state(tenant))
        if state.compile_level <= 0:
            wait = (1e-3 - state.compile_level) * 60.0 / rate
            raise self._refuse(
                LimitReason.COMPILE_SECONDS,
                max(1, math.ceil(wait - 1e-9)),
                f"This API key has spent its {rate:g} seconds of grammar compiles per "
                f"minute (--max-compile-seconds-per-minute-per-key); reuse a constraint "
                f"already compiled, or retry later.",
            )

    def charge_compile(self, tenant: bytes | None, seconds: float) -> None:
        """`tenant` (None: keyless) spent `seconds` compiling a constraint: counted in its
        account, and taken from its compile bucket (which may go into debt)."""
        state = self._refill(self._state(KEYLESS if tenant is None else tenant))
        state.compiled_s += seconds
        if tenant is not None and self.compile_seconds_per_minute:
            state.compile_level -= seconds

    def compile_seconds(self, tenant: bytes | None) -> float:
        """Compile seconds charged to `tenant` (None: the keyless tenant) so far."""
        state = self._tenants.get(KEYLESS if tenant is None else tenant)
        return state.compiled_s if state else 0.0

    def in_flight(self, tenant: bytes) -> int:
        """Requests of `tenant` holding a slot now."""
        state = self._tenants.get(tenant)
        return state.in_flight if state else 0

    def available(self, tenant: bytes) -> float:
        """Tokens in `tenant`'s bucket now (negative: a debt)."""
        return self._refill(self._state(tenant)).level

    def _state(self, tenant: bytes) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _Tenant(
                0,
                float(self.tokens_per_minute),
                self.clock(),
                float(self.compile_seconds_per_minute),
            )
        return state

    def _refill(self, state: _Tenant) -> _Tenant:
        now = self.clock()
        if self.tokens_per_minute:
            gained = (now - state.stamp) * self.tokens_per_minute / 60.0
            state.level = min(float(self.tokens_per_minute), state.level + gained)
        if rate := self.compile_seconds_per_minute:
            gained = (now - state.stamp) * rate / 60.0
            state.compile_level = min(rate, state.compile_level + gained)
        state.stamp = now
        return state

    def _tokens_refused(self, state: _Tenant, need: float, what: str) -> APIError:
        """429 for a request needing `need` tokens: Retry-After = whole seconds until the
        bucket holds them."""
        wait = (need - state.level) * 60.0 / self.tokens_per_minute
        return self._refuse(
            LimitReason.TOKENS,
            max(1, math.ceil(wait - 1e-9)),
            f"{what} of its {self.tokens_per_minute} tokens per minute "
            f"(--max-tokens-per-minute-per-key). Lower max_tokens, or retry "
            f"later.",
        )

    def _refuse(self, reason: LimitReason, retry_after: int, message: str) -> APIError:
        self.on_refused(reason)
        return APIError(
            429, message, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after)}
        )
