"""A sequence's position in its grammar: the mask for its next token, advanced by every token
it keeps. Preemption does not touch it (the tokens it has accepted stay the sequence's); a
forked completion gets its own copy; speculative drafts are checked against it and rolled
back."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar as xgr


class GrammarState:
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one kept token; False if the grammar does not allow it (nothing changes)."""
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the sequence is done."""
        return self._matcher.is_terminated()

    def fork(self) -> "GrammarState":
        return GrammarState(self._matcher.fork())

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (after the sequence's own) the grammar allows; unchanged after."""
        n = self._advance(tokens)
        if n:
            self._matcher.rollback(n)
        return n

    def fill_mask(self, bitmask: torch.Tensor, row: int, after: tuple[int, ...] = ()) -> bool:
        """Write the allowed next tokens after the sequence's tokens plus `after` into
        `bitmask[row]`; False (row untouched) if `after` leaves the grammar (such a row is
        never kept: the draft before it cannot be accepted). Unchanged after."""
        n = self._advance(after)
        ok = n == len(after)
        if ok:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        if n:
            self._matcher.rollback(n)
        return ok

    def _advance(self, tokens) -> int:
        n = 0
        while n < len(tokens) and self._matcher.accept_token(tokens[n]):
            n += 1
        return n
