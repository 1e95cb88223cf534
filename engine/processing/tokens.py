"""Plain values about tokens that cross process boundaries — a sampled token, a logprob
entry, a migrated request's outputs so far. Nothing here imports torch or the engine's
internals: the router, the conversions in `cluster/convert.py` and the engine share them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SampledToken:
    """What the sampler chose for one position (with its logprobs when asked for). Never
    changed once made (not `frozen`: one is made per row per step, and a frozen dataclass's
    __init__ costs ~4x a plain one's)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    rank: int = 0  # 1-based rank of token_id among the logprobs; 0 = not computed


@dataclass(slots=True)
class Logprob:
    """One position's logprob entry as reported to the caller."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
    rank: int = 0  # 1-based rank of token_id (1 = most likely); 0 = not computed


@dataclass(frozen=True, slots=True)
class Resume:
    """A request continued where another worker left it (the router migrating it off a
    failed one): the outputs it already produced and how much of their text the caller
    already has. Sampling continues at output position len(output_token_ids)."""

    output_token_ids: tuple[int, ...]
    num_text_chars: int  # characters of those outputs' text already streamed
