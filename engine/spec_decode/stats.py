"""Speculative decoding counters, named after vLLM's spec_decode metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify steps that had at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at draft position i

    def record(self, proposed: int, accepted: int, max_k: int) -> None:
        if len(self.accepted_per_pos) < max_k:
            self.accepted_per_pos += [0] * (max_k - len(self.accepted_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
