"""A sequence's position in its grammar: the mask for its next token, advanced by every token
it keeps. Preemption does not touch it (the tokens it has accepted stay the sequence's); a
forked completion gets its own copy; speculative drafts are checked against it and rolled
back. A reasoning request's state also holds its gate (engine/structured/gate.py): until the
reasoning ends, every token is allowed and the matcher sees none."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.structured.gate import ReasoningGate

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarState:
    def __init__(self, matcher: xgr.GrammarMatcher, gate: ReasoningGate | None = None) -> None:
        """`gate`: closed while the output is still reasoning; None: the grammar is active."""
        self._matcher = matcher
        self._gate = gate

    @property
    def active(self) -> bool:
        """The grammar binds the next token (the reasoning, if any, has ended)."""
        return self._gate is None

    def accept(self, token_id: int) -> bool:
        """Advance by one kept token; False if the grammar does not allow it (nothing changes)."""
        return self._advance((token_id,))[0] == 1

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sequence is done."""
        return self._gate is None and self._matcher.is_terminated()

    def fork(self) -> "GrammarState":
        return GrammarState(self._matcher.fork(), self._gate)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (after the sequence's own) the grammar allows; unchanged after."""
        gate = self._gate
        n, fed = self._advance(tokens)
        self._undo(gate, fed)
        return n

    def fill_mask(self, bitmask: torch.Tensor, row: int, after: tuple[int, ...] = ()) -> bool:
        """Write the allowed next tokens after the sequence's tokens plus `after` into
        `bitmask[row]`; True if it did. False (row untouched) if the gate is still closed
        after `after` (no mask), or if `after` leaves the grammar or ends with its stop token
        (such a row is never kept: the draft before it cannot be accepted, or the sequence
        ends there). Unchanged after."""
        gate = self._gate
        n, fed = self._advance(after)
        masked = n == len(after) and self._gate is None and not self._matcher.is_terminated()
        if masked:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        self._undo(gate, fed)
        return masked

    def _advance(self, tokens) -> tuple[int, int]:
        """Accept `tokens` while allowed: (how many, how many of them the matcher took)."""
        n = fed = 0
        while n < len(tokens):
            if self._gate is not None:  # reasoning: the matcher starts after the end marker
                self._gate = self._gate.after(tokens[n])
            elif not self._matcher.is_terminated() and self._matcher.accept_token(tokens[n]):
                fed += 1
            else:
                break
            n += 1
        return n, fed

    def _undo(self, gate: ReasoningGate | None, fed: int) -> None:
        self._gate = gate
        if fed:
            self._matcher.rollback(fed)
