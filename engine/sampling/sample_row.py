"""What the sampler draws one token for: a request's completion at one position."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import Request


@dataclass(slots=True)
class SampleRow:
    """One draw: for `request`'s completion `completion_index`, at the position after its
    tokens plus `drafts` (speculative tokens taken as accepted before this position, so
    masks, penalties and the seeded draw see the history this token would follow)."""

    request: Request
    completion_index: int  # which completion this draw is for (forks draw 0..n-1)
    drafts: tuple[int, ...] = ()

    @property
    def num_output_tokens(self) -> int:
        """Output tokens before this draw: it draws output position `num_output_tokens`."""
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + list(self.drafts)

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + list(self.drafts)
