"""An engine's fixed sizes, and the admission check that needs nothing else.

Frozen at construction and read-only: safe to use from any thread (the workers check a
request on their asyncio thread before handing it to the engine thread)."""

from __future__ import annotations

from dataclasses import dataclass


class RequestRejected(ValueError):
    """A request that can never run here (too long for the model or for the whole pool)."""


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    group_windows: tuple[int | None, ...] = (None,)
    """Each KV group's window: the block manager releases what slid out of it."""

    @property
    def kv_groups(self) -> int:
        """Block tables per request (engine/kv/kv_groups.py)."""
        return len(self.group_windows)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_held(self, num_tokens: int) -> int:
        """The most blocks a request computing `num_tokens` (and one more) ever holds, over
        all KV groups: a full-attention group all of its positions' blocks, a sliding one
        with chunked prefill those one chunk's queries read (a window, a chunk and a partial
        block on either side)."""
        whole = self.blocks_for(num_tokens + 1)
        held = 0
        for window in self.group_windows:
            if window is None or not self.chunked_prefill:
                held += whole
            else:
                held += min(whole, self.blocks_for(window - 1 + self.max_num_batched_tokens) + 1)
        return held

    def check_fits(self, num_tokens: int) -> None:
        """Raise RequestRejected if a request that must prefill `num_tokens` (its prompt, plus
        its earlier outputs when resumed) could never be scheduled."""
        n = num_tokens
        if n == 0:
            raise RequestRejected("the prompt is empty")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {n} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens (prompt + at least one output token)"
            )
        if self.blocks_held(n) > self.num_blocks:
            raise RequestRejected(
                f"the prompt needs {self.blocks_held(n)} KV blocks but the whole pool "
                f"has {self.num_blocks}"
            )
        if not self.chunked_prefill and n > self.max_num_batched_tokens:
            raise RequestRejected(
                f"the prompt has {n} tokens, more than max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) with chunked prefill off"
            )
