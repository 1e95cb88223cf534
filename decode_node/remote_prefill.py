"""Remote prefills on the decode side: one state machine per transfer attempt, owned by the
engine thread (`RemotePrefills`; every method runs there).

Life cycle of a remote prefill here (one transfer attempt of one request):

    PARKED ──KV complete──> KV_LANDED ──first token──> RUNNING
      │  └───first token──> FIRST_TOKEN ──KV complete──┘
      │                         │
      ├── failed while P may still write ──> QUARANTINED ──P stopped──> RELEASED
      └── failed after P stopped (FIRST_TOKEN, or P confirmed) ───────> RELEASED

- PARKED: the prompt's blocks are allocated, the request waits in the engine
  (WAITING_FOR_KV), the receiver expects the blocks, P's `Prefill` call is open.
- KV_LANDED: the receiver reported every block landed; P's first token is not back yet.
- FIRST_TOKEN: P's call returned the first token. P answers only after every write of the
  transfer completed, so from here on nothing more lands in the blocks.
- RUNNING: the request joined the running batch; the engine owns it (terminal here).
- QUARANTINED: the request was dropped (aborted in the engine, the receiver told to stop)
  while P may still write: the blocks are pinned, so a late write never lands in another
  request's KV.
- RELEASED: dropped, and P can no longer write: the blocks are back in the pool (terminal).

Only P releases blocks: its call returning (FIRST_TOKEN) or `writes_stopped` (its call ended
and its `Worker.Abort` answered, which it does once its sender reported the transfer) —
never a timer here. Every transition is in `_NEXT`; moving to the current state is a no-op,
so events may repeat and arrive in any order (a cancel racing P's answer, a receiver result
after the drop): each exit path converges on RUNNING or RELEASED.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, replace
from typing import Callable

from engine.core.request import Request
from engine.llm_engine import LLMEngine
from engine.processing.outputs import CompletionDelta
from engine.processing.tokens import SampledToken
from kvtransfer import KVReceiver, TransferResult, TransferStatus
from worker_runtime.contexts import Settle
from worker_runtime.grpc_errors import Unavailable

log = logging.getLogger(__name__)


class RemoteState(enum.IntEnum):
    """Where one transfer attempt is; `live` states hold a request in the engine."""

    PARKED = 0
    KV_LANDED = 1
    FIRST_TOKEN = 2
    RUNNING = 3
    QUARANTINED = 4
    RELEASED = 5

    @property
    def live(self) -> bool:
        return self < RemoteState.RUNNING

    @property
    def p_stopped(self) -> bool:
        """P writes nothing more into this attempt's blocks."""
        return self in (RemoteState.FIRST_TOKEN, RemoteState.RUNNING, RemoteState.RELEASED)


S = RemoteState
_NEXT: dict[RemoteState, frozenset[RemoteState]] = {
    S.PARKED: frozenset({S.KV_LANDED, S.FIRST_TOKEN, S.QUARANTINED, S.RELEASED}),
    S.KV_LANDED: frozenset({S.RUNNING, S.QUARANTINED, S.RELEASED}),
    S.FIRST_TOKEN: frozenset({S.RUNNING, S.RELEASED}),
    S.RUNNING: frozenset(),
    S.QUARANTINED: frozenset({S.RELEASED}),
    S.RELEASED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition `_NEXT` does not allow: a bug in the caller."""


@dataclass(slots=True, eq=False)
class RemotePrefill:
    """One transfer attempt: which of our blocks P writes, and where it stands."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    done: asyncio.Future[None]
    """Settled on the asyncio loop: None once RUNNING, the failure otherwise."""
    state: RemoteState = RemoteState.PARKED
    first_token: SampledToken | None = None
    announced: CompletionDelta | None = None
    """The first token's delta, already sent to the caller before the request ran here
    (`Deltas.preview_first`): admission delivers only what differs from it."""

    def advance(self, to: RemoteState) -> bool:
        """Move to `to`: True if it moved, False if already there; IllegalTransition else."""
        if to is self.state:
            return False
        if to not in _NEXT[self.state]:
            raise IllegalTransition(f"{self.transfer_id}: {self.state.name} -> {to.name}")
        self.state = to
        return True


class RemotePrefills:
    """Every transfer attempt until RUNNING or RELEASED, and the events that move them."""

    def __init__(
        self, receiver: KVReceiver, settle: Settle, deliver: Callable[[list[CompletionDelta]], None]
    ) -> None:
        self._receiver = receiver
        self._settle = settle  # resolve an asyncio future from here (the engine thread)
        self._deliver = deliver  # hand deltas to their streams
        self._attempts: dict[str, RemotePrefill] = {}  # by transfer id
        self._live: dict[str, RemotePrefill] = {}  # by request id: attempts in a live state

    # ---- queries -------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        return bool(self._live)

    @property
    def quarantined_blocks(self) -> int:
        return sum(len(a.block_ids) for a in self._attempts.values() if a.state is S.QUARANTINED)

    def state(self, transfer_id: str) -> RemoteState | None:
        attempt = self._attempts.get(transfer_id)
        return attempt.state if attempt is not None else None

    # ---- events --------------------------------------------------------------------------
    def start(
        self,
        engine: LLMEngine,
        request: Request,
        transfer_id: str,
        done: asyncio.Future,
        kv_timeout_s: float,
    ) -> RemotePrefill | None:
        """Park the request and expect its KV (PARKED); None if it cannot be parked now.
        `transfer_id` is new for every attempt (the caller picks it, so it can name the
        attempt even if it never saw this command's result)."""
        if request.request_id in self._live:
            raise ValueError(f"request_id {request.request_id!r} is already waiting for KV")
        block_ids = engine.add_remote_prefill_request(request)
        if block_ids is None:
            return None
        attempt = RemotePrefill(request.request_id, transfer_id, block_ids, done)
        try:
            # The KV may take as long as P needs to compute the prompt: it fails only after
            # `kv_timeout_s` without a word from P (kvtransfer/base.py: idle_s).
            self._receiver.expect(attempt.transfer_id, block_ids, idle_s=kv_timeout_s)
        except Exception:
            engine.abort_request(request.request_id)
            raise
        self._attempts[attempt.transfer_id] = self._live[request.request_id] = attempt
        return attempt

    def poll_kv(self, engine: LLMEngine) -> None:
        """After every engine step: apply the receiver's results."""
        for result in self._receiver.poll():
            attempt = self._attempts.get(result.request_id)
            if attempt is None or not attempt.state.live:
                continue  # e.g. the CANCELLED result of an attempt dropped earlier
            if result.status is TransferStatus.COMPLETE:
                self._to(
                    engine, attempt, S.RUNNING if attempt.state is S.FIRST_TOKEN else S.KV_LANDED
                )
            else:
                self.fail(engine, attempt.transfer_id, _kv_failure(attempt, result))

    def first_token(
        self,
        engine: LLMEngine,
        transfer_id: str,
        token: SampledToken,
        announced: CompletionDelta | None = None,
    ) -> None:
        """P's call returned `token`: every write of the transfer has completed. `announced`:
        the token's delta as already sent to the caller (None: not sent yet)."""
        # P answers once its writes completed: their notification is here or about to be.
        # Taking it now runs the request in this very step rather than after the next one.
        self.poll_kv(engine)
        attempt = self._attempts.get(transfer_id)
        if attempt is None:
            return
        if attempt.state is S.QUARANTINED:
            self._to(engine, attempt, S.RELEASED)
        elif attempt.state.live:
            attempt.first_token = token
            attempt.announced = announced
            self._to(engine, attempt, S.RUNNING if attempt.state is S.KV_LANDED else S.FIRST_TOKEN)

    def fail(self, engine: LLMEngine, transfer_id: str, exc: Exception) -> None:
        """Drop the attempt's request; its blocks stay quarantined unless P already stopped."""
        attempt = self._attempts.get(transfer_id)
        if attempt is not None and attempt.state.live:
            self._drop(
                engine, attempt, exc, S.RELEASED if attempt.state.p_stopped else S.QUARANTINED
            )

    def fail_request(self, engine: LLMEngine, request_id: str, exc: Exception) -> None:
        """`fail` the live attempt of `request_id`, if any (cancel, Worker.Abort)."""
        attempt = self._live.get(request_id)
        if attempt is not None:
            self.fail(engine, attempt.transfer_id, exc)

    def writes_stopped(self, engine: LLMEngine, transfer_id: str, exc: Exception) -> None:
        """P confirmed it writes nothing more for this attempt: fail it (with `exc`) if it is
        still live, and release its blocks."""
        attempt = self._attempts.get(transfer_id)
        if attempt is None:
            return
        if attempt.state.live:
            self._drop(engine, attempt, exc, S.RELEASED)
        elif attempt.state is S.QUARANTINED:
            self._to(engine, attempt, S.RELEASED)

    # ---- transitions: every side effect of entering a state is here ---------------------
    def _drop(
        self, engine: LLMEngine, attempt: RemotePrefill, exc: Exception, to: RemoteState
    ) -> None:
        self._receiver.cancel(attempt.transfer_id)
        if to is S.QUARANTINED:
            engine.block_manager.pool.pin(attempt.block_ids)  # outlive the request's own table
        del self._live[attempt.request_id]
        engine.abort_request(attempt.request_id)
        self._to(engine, attempt, to)
        self._settle(attempt.done, exc=exc)

    def _to(self, engine: LLMEngine, attempt: RemotePrefill, to: RemoteState) -> None:
        was = attempt.state
        if not attempt.advance(to):
            return
        if to is S.RUNNING:
            assert attempt.first_token is not None, "RUNNING follows P's first token"
            del self._live[attempt.request_id]
            del self._attempts[attempt.transfer_id]
            deltas = engine.finish_remote_prefill(attempt.request_id, attempt.first_token)
            if attempt.announced is not None:
                deltas = after_announced(deltas, attempt.announced)
            if deltas:
                self._deliver(deltas)
            self._settle(attempt.done)
        elif to is S.RELEASED:
            del self._attempts[attempt.transfer_id]
            if was is S.QUARANTINED:
                engine.block_manager.pool.release(attempt.block_ids)


def after_announced(
    deltas: list[CompletionDelta], announced: CompletionDelta
) -> list[CompletionDelta]:
    """What is left to send of an admission's deltas (its first is the first token's) once
    `announced`, the preview of that first delta, went out: nothing but the rest when they
    agree, which they do by construction (`Deltas.preview_first` runs the same checks on the
    same inputs). Should they ever differ, the caller keeps the tokens it has and gets the
    admission's end and any text beyond the preview's, and the difference is logged."""
    first, rest = deltas[0], deltas[1:]
    if first == announced:
        return rest
    log.error("first-token preview %s differs from the engine's %s", announced, first)
    more_text = first.text[len(announced.text) :] if first.text.startswith(announced.text) else ""
    return [replace(first, token_ids=[], logprobs=[], text=more_text), *rest]


def _kv_failure(attempt: RemotePrefill, result: TransferResult) -> Exception:
    if result.status is TransferStatus.TIMEOUT:
        return TimeoutError(
            f"KV for request {attempt.request_id} did not arrive: {result.error} "
            f"({result.elapsed_s:.1f}s after it was expected)"
        )
    return Unavailable(
        f"KV transfer for request {attempt.request_id} failed: "
        f"{result.status.name.lower()} {result.error}"
    )
