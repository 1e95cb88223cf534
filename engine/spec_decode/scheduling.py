"""The scheduler's speculation steps (a mixin of engine.core.scheduler.Scheduler, split out by
role): how many drafts a decoding sequence may verify, taking back the drafts the step ran
(`SchedulerOutput.with_drafts` sized it to them), and applying a verify result — kept
tokens under the stop rules, rejected drafts rolled back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.request import Request, RequestStatus
from engine.processing.tokens import SampledToken
from engine.spec_decode.proposer import Proposal

if TYPE_CHECKING:
    from engine.kv.block_manager import BlockManager
    from engine.spec_decode.stats import SpecDecodeStats


class SpeculationScheduling:
    bm: BlockManager
    max_model_len: int
    spec_stats: SpecDecodeStats

    if TYPE_CHECKING:  # provided by Scheduler

        def _append_token(self, request: Request, token: SampledToken) -> RequestStatus | None: ...

        def finish_request(self, request_id: str, status: RequestStatus) -> Request | None: ...

    def _take_drafts(self, request: Request, k: int, draft: Proposal) -> None:
        """A speculating request's drafts as the step ran them (`SchedulerOutput.drafts`):
        its draft KV's reach is recorded and the slots kept for drafts it did not get go
        back to the pool (before anything of the step is applied)."""
        if draft.num_draft_computed is not None:
            assert request.spec is not None  # only speculating requests draft
            request.spec.num_draft_computed = draft.num_draft_computed
        if len(draft.token_ids) < k:
            self.bm.trim(request, request.num_tokens + len(draft.token_ids))

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Drafts a decoding request may verify this step: its policy's allowance, cut so
        that the step fits the budget and every token it could keep stays within max_tokens
        and max_model_len (it keeps at most drafts + 1)."""
        if request.spec is None or request.pooling is not None:
            return 0
        room = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return max(0, min(request.spec.allowance(), room)) if room > 0 else 0

    def _apply_verified(
        self, request: Request, drafts: list[int], tokens: list[SampledToken]
    ) -> int:
        """A verify step's result for `drafts`: `tokens` = the accepted drafts, then the
        target's token.
        They are kept one by one under the stop rules (a stop drops the rest, so max_tokens,
        stop tokens and min_tokens hold at any acceptance length); num_computed_tokens
        covers the last token and the kept drafts only, so the rejected drafts' KV is never
        read or hashed, and the blocks only they needed go back to the pool. Returns the
        number of tokens kept."""
        spec = request.spec
        assert spec is not None  # only speculating requests verify
        proposed, accepted = len(drafts), len(tokens) - 1
        spec.record(proposed, accepted)
        self.spec_stats.record(proposed, accepted, spec.max_k)
        computed = request.num_computed_tokens
        kept, status = 0, None
        for token in tokens:
            kept += 1
            status = self._append_token(request, token)
            if status is not None:
                break
        # Inputs computed this step: the last token and the drafts; the kept ones are valid.
        request.num_computed_tokens = computed + 1 + min(accepted, kept - 1)
        spec.num_draft_computed = min(spec.num_draft_computed, request.num_computed_tokens)
        self.bm.cache_full_blocks(request)
        if status is not None:
            self.finish_request(request.request_id, status)
        else:
            self.bm.trim(request, request.num_tokens)
        return kept
