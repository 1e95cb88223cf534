"""From (prompt, SamplingParams) to a validated engine Request, as vLLM's input processing
does it: tokenization, id checks, prompt truncation, the generation config's eos ids, bad
words as token sequences.

Safe from any thread: it reads only the tokenizer (stateless) and fixed sizes, and draws
seeds under a lock."""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

from engine.core.request import Request
from engine.kv.block_hash import compute_block_hashes, hash_extras
from engine.lora.adapter import LoRAAdapter
from engine.processing.tokenizer import Tokenizer
from engine.processing.tokens import Resume
from engine.sampling.pooling import PoolingParams
from engine.sampling.sampling_params import SamplingParams
from engine.structured.compile_process import CompileLimits

if TYPE_CHECKING:
    from engine.structured.compiler import GrammarCompiler


class RequestBuilder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        seed: int,
        kv_cache_dtype: str = "auto",
        grammar_limits: CompileLimits = CompileLimits(),
    ) -> None:
        self.tokenizer = tokenizer
        self.kv_cache_dtype = kv_cache_dtype  # normalized; enters the block hashes
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self._seed_rng = random.Random(seed)  # seeds for requests that bring none
        self._seed_lock = threading.Lock()  # build() runs on worker asyncio threads too
        self._grammar_limits = grammar_limits
        self._grammars: GrammarCompiler | None = None  # on the first structured request
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler for this vocabulary (built once, on first use:
        importing and indexing the vocabulary takes a moment), within `grammar_limits` (size,
        compile time: engine/structured/compiler.py)."""
        with self._grammars_lock:
            if self._grammars is None:
                from engine.structured.compiler import GrammarCompiler

                self._grammars = GrammarCompiler(
                    self.tokenizer,
                    self.vocab_size,
                    self.tokenizer.stop_token_ids,
                    self._grammar_limits,
                )
            return self._grammars

    def build(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        resume: Resume | None = None,
        pooling: PoolingParams | None = None,
        lora: LoRAAdapter | None = None,
        weights_version: int = 0,
    ) -> Request:
        """Raises ValueError with a message that starts with the offending field. `resume`:
        continue after outputs produced elsewhere (n must be 1; at most max_tokens).
        `pooling`: a pooling (embedding) request; it never samples (`params` only truncate).
        A structured-output request compiles its grammar here (off the engine thread) and
        replays `resume`'s outputs into its matcher. `lora`: the adapter it runs with (its
        id enters the block hashes). `weights_version`: the engine's when the request
        arrives (it enters the block hashes)."""
        if pooling is not None and (resume is not None or params.n != 1):
            raise ValueError("pooling: a pooling request has n == 1 and no resume")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = [int(t) for t in prompt]
        so = params.structured_outputs
        for name, ids in (
            ("prompt", token_ids),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("resume_output_token_ids", resume.output_token_ids if resume else ()),
            ("reasoning_start", so.reasoning_start or () if so else ()),
            ("reasoning_end", so.reasoning_end or () if so else ()),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name} token ids must be in [0, {self.vocab_size}), got {bad[:5]}"
                )
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        room = self.max_model_len - len(token_ids)  # <= 0 is rejected by the scheduler
        if params.seed is None:
            with self._seed_lock:
                seed = self._seed_rng.getrandbits(63)
        else:
            seed = params.seed
        params, eos = self._eos_rules(params)
        max_tokens = max(1, min(params.max_tokens or room, room))
        outputs = list(resume.output_token_ids) if resume else []
        # All max_tokens outputs: only the end was lost; the scheduler ends it at once.
        if resume is not None and (params.n != 1 or len(outputs) > max_tokens):
            raise ValueError(
                f"resume_output_token_ids: a resumed request needs n == 1 and at most "
                f"max_tokens ({max_tokens}) outputs, got n={params.n}, {len(outputs)} outputs"
            )
        lora_id = lora.lora_int_id if lora is not None else None
        grammar = None
        if params.structured_outputs is not None and pooling is None:
            # The gate follows from the prompt, then from the replayed outputs.
            # Tenants take turns at the compile processes; the cache salt tells them apart.
            grammar = self.grammars.matcher(params.structured_outputs, token_ids, cache_salt)
            if grammar.valid_prefix(outputs) != len(outputs):
                raise ValueError(
                    "resume_output_token_ids: the outputs do not follow the "
                    "request's structured_outputs"
                )
            for token in outputs:
                grammar.accept(token)
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=params,
            seed=seed,
            eos_token_ids=eos,
            max_tokens=max_tokens,
            token_ids=token_ids + outputs,
            resume=resume,
            # Over the outputs too: a request resumed again on this worker finds them cached.
            block_hashes=compute_block_hashes(
                token_ids + outputs,
                self.block_size,
                cache_salt,
                lora_id,
                self.kv_cache_dtype,
                weights_version,
            ),
            hash_extras=hash_extras(cache_salt, lora_id, self.kv_cache_dtype, weights_version),
            cache_salt=cache_salt,
            priority=priority,
            bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
            pooling=pooling,
            grammar=grammar,
            lora=lora,
        )

    def _eos_rules(self, params: SamplingParams) -> tuple[SamplingParams, frozenset[int]]:
        """(params, eos ids) as vLLM's update_from_generation_config leaves them: the
        tokenizer's eos stops as EOS (stop_reason None); the generation config's other eos
        ids join stop_token_ids (stop_reason = the id). With ignore_eos none of them stops,
        and all stay masked until min_tokens."""
        all_eos = self.tokenizer.stop_token_ids
        if params.ignore_eos:
            return params, all_eos
        primary = self.tokenizer.eos_token_id
        extra = sorted(all_eos - {primary} - set(params.stop_token_ids))
        if extra:
            params = replace(params, stop_token_ids=(*params.stop_token_ids, *extra))
        return params, frozenset() if primary is None else frozenset({primary})

    def _bad_words_token_ids(self, bad_words: tuple[str, ...]) -> list[list[int]]:
        """vLLM's tokenization of bad words: each word (left-stripped) as-is, and with a
        leading space when that gives a different first token and as many tokens."""
        out: list[list[int]] = []
        for word in bad_words:
            plain = self.tokenizer.encode(word.lstrip())
            spaced = self.tokenizer.encode(" " + word.lstrip())
            out.append(plain)
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out
