"""Glue between live state and the pure policy: builds `Candidate`s from the registry (load,
staleness, this router's in-flight work) and the KV index (each worker's cached prefix of
this prompt), asks the policy, and returns the workers' registrations with its decision."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from cluster.registration import WorkerInfo
from cluster.roles import Role
from engine.block_hash import BlockHash
from engine.lora.request import LoRARequest
from router.kv_index import KVIndex, prompt_block_hashes
from router.policy import Candidate, Decision, Policy
from router.registry import WorkerRegistry, WorkerState


@dataclass
class PromptKey:
    """A prompt's identity for the prefix cache; its block hashes are computed once per
    (block size, KV cache dtype, weights version) in use, however often the request is placed (queueing,
    retries)."""

    token_ids: list[int]
    cache_salt: str | None = None
    lora: LoRARequest | None = None
    """The LoRA adapter it runs with: its id enters the block hashes; placement prefers
    workers that have it loaded."""
    _hashes: dict[tuple[int, str, int], list[BlockHash]] = field(default_factory=dict, repr=False)

    def hashes(self, block_size: int, kv_cache_dtype: str = "auto",
               weights_version: int = 0) -> list[BlockHash]:
        key = (block_size, kv_cache_dtype, weights_version)
        h = self._hashes.get(key)
        if h is None:
            h = self._hashes[key] = prompt_block_hashes(
                self.token_ids, block_size, self.cache_salt,
                self.lora.lora_int_id if self.lora is not None else None, kv_cache_dtype,
                weights_version,
            )
        return h


@dataclass(frozen=True, slots=True)
class Placement:
    decision: Decision
    decode: WorkerState
    prefill: WorkerState | None

    @property
    def decode_info(self) -> WorkerInfo:
        return self.decode.info


class Placer:
    def __init__(self, registry: WorkerRegistry, index: KVIndex, policy: Policy) -> None:
        self.registry = registry
        self.index = index
        self.policy = policy

    def place(self, prompt: PromptKey, exclude: frozenset[str] = frozenset(),
              remote_prefill: bool = True, context: int = 0) -> Placement | None:
        """`remote_prefill=False`: the decode worker must prefill (n > 1, prompt logprobs).
        `context`: prompt + output tokens; decode workers whose published max_model_len is
        smaller are never chosen (unpublished, 0: assumed to fit)."""
        num_tokens = len(prompt.token_ids)
        candidate = self._candidates(prompt)
        states = {s.info.worker_id: s for s in self.registry.all() if s.info.worker_id not in exclude}
        decode = [candidate(s) for s in states.values() if s.info.role == Role.DECODE
                  and (s.info.max_model_len == 0 or context <= s.info.max_model_len)]
        prefill = [candidate(s) for s in states.values()
                   if s.info.role == Role.PREFILL and remote_prefill]
        decision = self.policy.place(num_tokens, decode, prefill)
        if decision is None:
            return None
        p = decision.prefill
        return Placement(decision, states[decision.decode.worker_id],
                         states[p.worker_id] if p is not None else None)

    def place_prefill(self, prompt: PromptKey, exclude: frozenset[str] = frozenset()
                      ) -> WorkerState | None:
        """A prefill worker alone, for prompt-only work (embeddings): the policy's prefill
        choice (prefix affinity vs queued prefill work) among prefill workers whose
        published max_model_len holds the prompt. None: no usable one."""
        candidate = self._candidates(prompt)
        num_tokens = len(prompt.token_ids)
        states = {s.info.worker_id: s for s in self.registry.by_role(Role.PREFILL)
                  if s.info.worker_id not in exclude
                  and (s.info.max_model_len == 0 or num_tokens < s.info.max_model_len)}
        chosen = self.policy.place_prefill(num_tokens, [candidate(s) for s in states.values()])
        return states[chosen.worker_id] if chosen is not None else None

    def _candidates(self, prompt: PromptKey) -> Callable[[WorkerState], Candidate]:
        """WorkerState -> Candidate for this prompt (KV-index matches computed once per
        (block size, KV cache dtype, weights version), the staleness clock read once). A
        sleeping worker counts as draining (no new work); workers pair only when both their KV
        layout (compat hash) and their weights version agree: KV computed by other weights
        must not be joined."""
        now = self.registry.clock()
        matches: dict[tuple[int, str, int], dict[str, int]] = {}
        adapter = prompt.lora.lora_name if prompt.lora is not None else None

        def candidate(state: WorkerState) -> Candidate:
            info = state.info
            bs, kv, wv = info.block_size, info.kv_cache_dtype, info.weights_version
            match = matches.get((bs, kv, wv))
            if match is None:
                match = matches[bs, kv, wv] = self.index.match(prompt.hashes(bs, kv, wv))
            return Candidate(
                worker_id=info.worker_id, capacity=info.capacity, block_size=bs,
                cached_tokens=match.get(info.worker_id, 0) * bs,
                inflight=state.inflight, inflight_prefill_tokens=state.inflight_prefill_tokens,
                compat=f"{info.compat_hash}/w{wv}", draining=info.draining or info.sleeping,
                stale=self.registry.is_stale(state, now),
                lora_missing=adapter is not None and adapter not in info.resident_loras,
            )

        return candidate
