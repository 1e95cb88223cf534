"""N-gram (prompt-lookup) proposer: if the sequence's last n tokens occurred earlier in it,
draft the tokens that followed that occurrence (the most recent one; the longest n from
prompt_lookup_max down to prompt_lookup_min). Pure CPU over token ids: no model, no KV."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.core.request import Request
from engine.spec_decode.proposer import Proposal


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, batch: list[tuple[Request, int]]) -> list[Proposal]:
        return [Proposal(self.lookup(request.token_ids, k)) for request, k in batch]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so each has a continuation.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        pass  # no KV of its own
