"""A request inside the engine: counters for progress, an enum for its life cycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.kv.block_hash import BlockHash
from engine.lora.adapter import LoRAAdapter
from engine.processing.tokens import Logprob, Resume
from engine.sampling.pooling import PoolingParams
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.state import SpecState
from engine.structured.state import GrammarState


class RequestStatus(enum.IntEnum):
    """Order matters: everything after PREEMPTED is finished."""

    WAITING = 0
    WAITING_FOR_KV = 1  # decode worker: blocks allocated, KV arriving from a prefill worker
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. Progress is `num_computed_tokens` catching up to `num_tokens`: prompt
    prefill (chunked or not), prefix-cache hits, KV that arrived from a prefill worker and
    decoding are all the same counter moving.

    A request with `sampling.n > 1` runs its prompt once; when the prompt is done it forks
    into n completions (`completion_index` 0..n-1) sharing the prompt's blocks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    seed: int  # effective seed: the request's own, or one drawn at arrival
    eos_token_ids: frozenset[int]  # stop as EOS (none do with ignore_eos); masked until min_tokens
    max_tokens: int  # resolved against max_model_len
    block_hashes: list[BlockHash]
    hash_extras: bytes = b""
    cache_salt: str | None = None
    priority: int = 0  # lower is scheduled first; ties in arrival order
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # from sampling.bad_words
    completion_index: int = 0
    parent_id: str | None = None  # set on completions forked from a request with n > 1
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule; -1 = not yet scheduled
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)
    """sampling.prompt_logprobs set: prompt tokens 1.. so far (the runner computes them as the
    prompt's chunks run, the scheduler appends them; a recomputed position is not computed
    twice)."""
    stop_reason: str | int | None = None  # FINISHED_STOPPED: stop string or stop token id
    block_tables: list[list[int]] = field(default_factory=list)
    """One block table per KV group (engine/kv/kv_groups.py), set by the block manager."""
    keep_blocks_from: list[int] | None = None
    """Per KV group, the table index from which every block is kept until the request ends
    (a prefill worker streams them to a decode worker); None: release as the windows move."""
    remote_skip_blocks: list[int] | None = None
    """Decode worker, KV computed elsewhere: per KV group, the leading prompt blocks the
    prefill worker does not fill (the local hit; a sliding group's blocks the first decode
    step no longer reads). Set by Scheduler.allocate_for_remote_kv."""
    """Set by the block manager on allocation (the same list it updates); kept after the
    request is freed, so callers can still see which blocks it used."""
    resume: Resume | None = None
    """Set: `token_ids` starts as prompt + resume.output_token_ids (prefilled together)."""
    lora: LoRAAdapter | None = None
    """The LoRA adapter it runs with (its id is in `hash_extras`)."""
    grammar: GrammarState | None = None
    """Set for structured outputs: the matcher its sampled tokens must follow (advanced by
    every token it keeps; engine/structured)."""
    spec: SpecState | None = None
    """Set when the engine speculates: this sequence's drafts and their policy."""
    pooling: PoolingParams | None = None
    """Set: a pooling (embedding) request — it never samples; it finishes ("stop") once its
    prompt is computed, with `embedding` set (engine/sampling/pooling.py)."""
    embedding: list[float] | None = None
    """A pooling request's result, set when its prompt is computed."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def remote_prefill_ok(self) -> bool:
        """The one rule for where a request prefills: a prefill worker samples output
        position 0 from the prompt alone, so requests that need more (see
        `SamplingParams.remote_prefill_ok`) or continue earlier outputs prefill where they
        decode."""
        return self.sampling.remote_prefill_ok and self.resume is None

    @property
    def computes_whole_prompt(self) -> bool:
        """Needs a result at every prompt position (prompt logprobs, mean pooling): no
        prefix-cache hits."""
        return self.sampling.prompt_logprobs is not None or (
            self.pooling is not None and self.pooling.needs_every_position
        )

    @property
    def group_id(self) -> str:
        """The id the caller used (shared by all n completions)."""
        return self.parent_id or self.request_id

    @property
    def pending_forks(self) -> int:
        """Completions still to be forked off when this request samples its first token."""
        return self.sampling.n - 1 if self.parent_id is None and self.num_output_tokens == 0 else 0

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
