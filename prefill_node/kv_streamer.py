"""Streams a prompt's KV blocks to the decode worker as the prefill engine completes them.

Runs on the engine thread after every step. For each prefill in flight: blocks that became
full (and computed) since the last step are pinned and written at once, so the transfer of
chunk k overlaps the compute of chunk k+1; when the request has sampled its first token, the
remaining blocks (the last, partial one included) go out in the final batch, which carries
the completion notification. Pinned blocks are released only when the sender reports the
request (complete or failed) — for a cancelled or failed request that is once none of its
writes can still read them, however long the transport takes to let go of a write. The
engine's own request is already finished by then, so the blocks become cached-free prefix
cache — nothing is held for the decode side. `when_ended` tells the worker when a request
has nothing left in flight (its `Worker.Abort` answers then).

A destination may come after the prefill started (`deferred`: the decode worker parks the
request while this worker already computes it): until `set_destination` nothing goes out, and
a request that finishes first has its prompt blocks pinned (held) until the destination comes
or its deadline passes.

The caller hears of a complete transfer as soon as the sender reports it (`answer_early`, the
sender's listener, called on the transfer-progress thread between engine steps): the first
token is fixed once the final batch goes out, so its answer does not wait for this worker's
next step (a whole prefill of the next prompt). Its pinned blocks are released after that
step, as above.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from engine.core.request import Request
from engine.llm_engine import LLMEngine
from engine.processing.tokens import SampledToken
from kvtransfer import KVSender, KVTransferError, TransferResult, TransferStatus


@dataclass
class Outgoing:
    """One prefill being streamed."""

    request: Request
    transfer_id: str  # what the decode worker's receiver expects
    peer: str
    dest_blocks: list[int] | None  # decode-side ids: each KV group's prompt blocks after its skip
    group_skips: (
        list[int] | None
    )  # per KV group: leading prompt blocks the decode worker does not need
    """dest_blocks and group_skips: None until `set_destination` for a deferred destination."""
    deadline: float
    """Until when a deferred destination may come."""
    idle_s: float
    """The transfer's progress window (`KVSender.send`): it fails only when a write stalls
    this long; while the prompt computes (or waits here), keepalives tell the decode worker
    it is coming — however long the prompt takes."""
    on_done: Callable[[TransferResult, SampledToken | None], None]
    """Called once: on the engine thread, or on the progress thread for a complete transfer."""
    sent: int = 0  # prompt blocks handled so far (sent or skipped)
    pinned: list[int] = field(default_factory=list)
    final_sent: bool = False
    first_token: SampledToken | None = None  # set when the final batch goes out
    held: bool = False  # finished before its destination came: its prompt blocks are pinned


class KVStreamer:
    def __init__(self, sender: KVSender) -> None:
        self.sender = sender
        self.active: dict[str, Outgoing] = {}  # by transfer id
        self._waiters: dict[str, list[Callable[[], None]]] = {}  # by request id
        self._final: dict[str, Outgoing] = {}
        """Final batches in flight, by transfer id: written on the engine thread before the
        final send, taken by whichever of `answer_early` and `_finish` comes first."""

    def add(self, out: Outgoing) -> None:
        self.active[out.transfer_id] = out

    def set_destination(
        self, engine: LLMEngine, transfer_id: str, dest_blocks: list[int], group_skips: list[int]
    ) -> None:
        """The deferred destination of `transfer_id` (checked by the caller); what is ready
        goes out at once. KeyError: no such prefill in flight; ValueError: it has one."""
        out = self.active.get(transfer_id)
        if out is None or out.final_sent:
            raise KeyError(transfer_id)
        if out.dest_blocks is not None:
            raise ValueError(f"transfer {transfer_id} already has its destination")
        out.dest_blocks, out.group_skips = dest_blocks, group_skips
        self._advance(engine, out)

    def cancel(self, engine: LLMEngine, transfer_id: str) -> None:
        """Stop streaming (the request is aborted in the engine by the caller)."""
        out = self.active.get(transfer_id)
        if out is not None:
            self._stop(engine, out)

    def cancel_request(self, engine: LLMEngine, request_id: str) -> bool:
        """`cancel` every transfer of `request_id`; False if it has none in flight."""
        outs = [o for o in self.active.values() if o.request.request_id == request_id]
        for out in outs:
            self._stop(engine, out)
        return bool(outs)

    def when_ended(self, request_id: str, callback: Callable[[], None]) -> None:
        """Call `callback` (on the engine thread) once no transfer of `request_id` is in
        flight any more: at once if none is."""
        if any(o.request.request_id == request_id for o in self.active.values()):
            self._waiters.setdefault(request_id, []).append(callback)
        else:
            callback()

    def _stop(self, engine: LLMEngine, out: Outgoing) -> None:
        out.final_sent = True  # nothing more goes out
        if not self.sender.cancel(out.transfer_id) and self.sender.status(out.transfer_id) is None:
            # The sender never heard of it (nothing posted): finish it here. Otherwise its
            # poll() reports it once none of its writes can still read our blocks.
            self._finish(engine, out, None, TransferStatus.CANCELLED)

    def after_step(self, engine: LLMEngine) -> bool:
        for out in list(self.active.values()):
            self._advance(engine, out)
        for result in self.sender.poll():
            sending = self.active.get(result.request_id)
            if sending is not None:
                self._finish(engine, sending, result)
        return bool(self.active)

    def _advance(self, engine: LLMEngine, out: Outgoing) -> None:
        """Send what became ready of `out` (blocks completed since the last call; with the
        first token sampled, the rest as the final batch), hold it until its destination."""
        bm = engine.block_manager
        req = out.request
        if out.final_sent:
            return  # all sent
        if out.dest_blocks is not None and self.sender.status(out.transfer_id) is None:
            self.open(out)  # queued here or computing: the decode worker hears we are coming
        if not req.block_tables:
            return  # not admitted yet
        if req.status.is_finished and req.num_output_tokens == 0:  # aborted in the engine
            self._stop(engine, out)
            return
        prompt_blocks = bm.blocks_for(req.num_prompt_tokens)
        final = req.num_output_tokens > 0  # the first token is sampled: all KV computed
        if out.dest_blocks is None or out.group_skips is None:  # deferred: nothing goes out yet
            if final and not out.held:  # finished this step: keep its blocks for the sender
                blocks = [table[i] for table in req.block_tables for i in range(prompt_blocks)]
                bm.pool.pin(blocks)
                out.pinned += blocks
                out.held = True
            if time.monotonic() > out.deadline:
                self._finish(
                    engine,
                    out,
                    None,
                    TransferStatus.TIMEOUT,
                    "the decode worker sent no destination in time",
                )
            return
        upto = (
            prompt_blocks if final else min(req.num_computed_tokens // bm.block_size, prompt_blocks)
        )
        # The destination lists each KV group's blocks after its skip, group after group.
        pairs, base = [], 0
        for table, skip in zip(req.block_tables, out.group_skips):
            pairs += [
                (table[i], out.dest_blocks[base + i - skip])
                for i in range(max(out.sent, skip), upto)
            ]
            base += prompt_blocks - skip
        if not pairs and not final:
            return  # nothing new; the sender's keepalives say we are computing
        blocks = [local for local, _ in pairs]
        bm.pool.pin(blocks)  # freed-this-step blocks are taken back before any reuse
        out.pinned += blocks
        out.sent = upto
        out.final_sent = final
        if final:
            out.first_token = _first_token(req)
            self._final[out.transfer_id] = out
        try:
            self.sender.send(out.transfer_id, out.peer, pairs, final=final, idle_s=out.idle_s)
        except Exception as exc:  # refused before posting: fail this request only
            self._finish(engine, out, None, TransferStatus.ERROR, str(exc))

    def open(self, out: Outgoing) -> None:
        """Open `out`'s transfer (its destination is known): the sender's keepalives start.
        Any thread, before the destination reaches the engine thread (the prefill worker does
        it on SetDestination, so a long step of another prompt cannot delay it); a transfer
        that already ended or already sent its final batch is left as it is."""
        try:
            self.sender.send(out.transfer_id, out.peer, [], final=False, idle_s=out.idle_s)
        except KVTransferError:
            pass  # ended or final: nothing to keep alive

    def answer_early(self, result: TransferResult) -> None:
        """The sender's listener (any thread): answer the caller of a transfer that completed."""
        out = self._final.pop(result.request_id, None)
        if out is not None and result.status is TransferStatus.COMPLETE:
            out.on_done(result, out.first_token)

    def _finish(
        self,
        engine: LLMEngine,
        out: Outgoing,
        result: TransferResult | None,
        status: TransferStatus | None = None,
        error: str = "",
    ) -> None:
        self.active.pop(out.transfer_id, None)
        final_pending = self._final.pop(out.transfer_id, None) is not None
        engine.block_manager.pool.release(out.pinned)
        out.pinned = []
        if result is None:
            assert status is not None, "a finish without the sender's result names its status"
            result = TransferResult(out.transfer_id, status, out.peer, 0, 0, 0.0, error)
        req = out.request
        complete = result.status is TransferStatus.COMPLETE
        if not complete:
            engine.abort_request(req.request_id)
        if not (complete and out.first_token is not None and not final_pending):  # answered early
            out.on_done(result, out.first_token if complete else None)
        rid = req.request_id
        if rid in self._waiters and not any(
            o.request.request_id == rid for o in self.active.values()
        ):
            for callback in self._waiters.pop(rid):
                callback()


def _first_token(req: Request) -> SampledToken:
    lp = req.logprobs[0] if req.logprobs else None
    return SampledToken(
        req.output_token_ids[0], lp.logprob if lp else None, tuple(lp.top) if lp else ()
    )
