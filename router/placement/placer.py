"""Glue between live state and the pure policy: builds `Candidate`s from the registry (load,
staleness, this router's in-flight work) and the KV index (each worker's cached prefix of
this prompt, and how much of it sits in its second tier), asks the policy, and returns the
workers' registrations with its decision — and, when the worker computing the prompt should
pull blocks a peer holds, that peer (`KVSource`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from cluster.registration import WorkerInfo
from cluster.roles import Role
from engine.kv.block_hash import BlockHash
from engine.lora.request import LoRARequest
from router.metrics import RouterMetrics
from router.placement.index import KVIndex, PrefixHit, prompt_block_hashes
from router.placement.policy import Candidate, Decision, Policy
from router.placement.registry import WorkerRegistry, WorkerState

_NO_HIT = PrefixHit(0, 0)


@dataclass
class PromptKey:
    """A prompt's identity for the prefix cache; its block hashes are computed once per
    (block size, KV cache dtype, weights version) in use, however often the request is placed
    (queueing, retries)."""

    token_ids: list[int]
    cache_salt: str | None = None
    lora: LoRARequest | None = None
    """The LoRA adapter it runs with: its id enters the block hashes; placement prefers
    workers that have it loaded."""
    _hashes: dict[tuple[int, str, int], list[BlockHash]] = field(default_factory=dict, repr=False)

    def hashes(
        self, block_size: int, kv_cache_dtype: str = "auto", weights_version: int = 0
    ) -> list[BlockHash]:
        key = (block_size, kv_cache_dtype, weights_version)
        h = self._hashes.get(key)
        if h is None:
            h = self._hashes[key] = prompt_block_hashes(
                self.token_ids,
                block_size,
                self.cache_salt,
                self.lora.lora_int_id if self.lora is not None else None,
                kv_cache_dtype,
                weights_version,
            )
        return h


@dataclass(frozen=True, slots=True)
class KVSource:
    """Where the worker computing a prompt pulls its leading blocks from first."""

    holder: WorkerState
    """The worker to pull from."""
    num_blocks: int
    """Leading prompt blocks to pull (counted from block 0; the puller skips what it has)."""
    num_tier_blocks: int
    """How many of those sit in the holder's second tier."""


@dataclass(frozen=True, slots=True)
class Placement:
    decision: Decision
    decode: WorkerState
    prefill: WorkerState | None
    kv_source: KVSource | None = None
    """Blocks the computing worker (`prefill` if set, else `decode`) pulls first; None: it
    reuses only its own cache."""

    @property
    def decode_info(self) -> WorkerInfo:
        return self.decode.info


class Placer:
    def __init__(
        self,
        registry: WorkerRegistry,
        index: KVIndex,
        policy: Policy,
        metrics: RouterMetrics | None = None,
    ) -> None:
        """`metrics`: where pull decisions are counted (None: not counted)."""
        self.registry = registry
        self.index = index
        self.policy = policy
        self.metrics = metrics

    def place(
        self,
        prompt: PromptKey,
        exclude: frozenset[str] = frozenset(),
        remote_prefill: bool = True,
        context: int = 0,
    ) -> Placement | None:
        """`remote_prefill=False`: the decode worker must prefill (n > 1, prompt logprobs).
        `context`: prompt + output tokens; decode workers whose published max_model_len is
        smaller are never chosen (unpublished, 0: assumed to fit)."""
        num_tokens = len(prompt.token_ids)
        candidate = self._candidates(prompt)
        states = {
            s.info.worker_id: s for s in self.registry.all() if s.info.worker_id not in exclude
        }
        cands = {wid: candidate(s) for wid, s in states.items()}
        decode = [
            cands[wid]
            for wid, s in states.items()
            if s.info.role == Role.DECODE
            and (s.info.max_model_len == 0 or context <= s.info.max_model_len)
        ]
        prefill = [
            cands[wid]
            for wid, s in states.items()
            if s.info.role == Role.PREFILL and remote_prefill
        ]
        peers = [c for c in cands.values() if c.cached_tokens > 0]  # any role: they hold KV
        decision = self.policy.place(num_tokens, decode, prefill, peers)
        if decision is None:
            return None
        p, plan = decision.prefill, decision.kv_pull
        if self.metrics is not None and (plan is not None or decision.kv_pull_declined):
            self.metrics.kv_pull_decisions.labels("pull" if plan else "recompute").inc()
        source = (
            None
            if plan is None
            else KVSource(states[plan.holder.worker_id], plan.num_blocks, plan.num_tier_blocks)
        )
        return Placement(
            decision,
            states[decision.decode.worker_id],
            states[p.worker_id] if p is not None else None,
            source,
        )

    def place_prefill(
        self, prompt: PromptKey, exclude: frozenset[str] = frozenset()
    ) -> WorkerState | None:
        """A prefill worker alone, for prompt-only work (embeddings): the policy's prefill
        choice (prefix affinity vs queued prefill work) among prefill workers whose
        published max_model_len holds the prompt. None: no usable one."""
        candidate = self._candidates(prompt)
        num_tokens = len(prompt.token_ids)
        states = {
            s.info.worker_id: s
            for s in self.registry.by_role(Role.PREFILL)
            if s.info.worker_id not in exclude
            and (s.info.max_model_len == 0 or num_tokens < s.info.max_model_len)
        }
        chosen = self.policy.place_prefill(num_tokens, [candidate(s) for s in states.values()])
        return states[chosen.worker_id] if chosen is not None else None

    def _candidates(self, prompt: PromptKey) -> Callable[[WorkerState], Candidate]:
        """WorkerState -> Candidate for this prompt (KV-index matches computed once per
        (block size, KV cache dtype, weights version), the staleness clock read once). A
        sleeping worker counts as draining (no new work); workers pair only when both their KV
        layout (compat hash) and their weights version agree: KV computed by other weights
        must not be joined."""
        now = self.registry.clock()
        matches: dict[tuple[int, str, int], dict[str, PrefixHit]] = {}
        adapter = prompt.lora.lora_name if prompt.lora is not None else None

        def candidate(state: WorkerState) -> Candidate:
            info = state.info
            bs, kv, wv = info.block_size, info.kv_cache_dtype, info.weights_version
            match = matches.get((bs, kv, wv))
            if match is None:
                match = matches[bs, kv, wv] = self.index.match(prompt.hashes(bs, kv, wv))
            hit = match.get(info.worker_id, _NO_HIT)
            return Candidate(
                worker_id=info.worker_id,
                capacity=info.capacity,
                block_size=bs,
                cached_tokens=hit.blocks * bs,
                cached_tier_blocks=hit.tier_blocks,
                inflight=state.inflight,
                inflight_prefill_tokens=state.inflight_prefill_tokens,
                compat=f"{info.compat_hash}/w{wv}",
                draining=info.draining or info.sleeping,
                stale=self.registry.is_stale(state, now),
                lora_missing=adapter is not None and adapter not in info.resident_loras,
            )

        return candidate
