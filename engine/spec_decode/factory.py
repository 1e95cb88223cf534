"""Build the proposer an engine's speculative_config asks for, checking it against the
target model: every mistake is an error when the engine starts, never a silent fallback."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.checks import FieldError
from engine.kv_pool import allocate_kv_pool
from engine.models.loader import load_model
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

_PROBE_TEXT = "Speculative decoding drafts tokens: 123, ünïcödé, {\"json\": true}\n"


def make_proposer(engine: LLMEngine) -> Proposer | None:
    spec = engine.config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    target = engine.loaded
    layers = spec.self_draft_layers
    if layers is not None:
        if layers >= target.args.n_layers:
            raise FieldError("model", f"speculative_config model self:{layers} must use fewer "
                                      f"layers than the target's {target.args.n_layers}")
        return DraftModelProposer(target.model, engine.kv_cache, engine.backend,
                                  engine.block_manager, num_layers=layers)
    draft = load_model(spec.model, engine.dtype, engine.device)
    if (draft.args.vocab_size != target.args.vocab_size
            or draft.tokenizer.encode(_PROBE_TEXT) != target.tokenizer.encode(_PROBE_TEXT)):
        raise FieldError("model", f"speculative_config model {spec.model!r} has another vocabulary "
                                  f"({draft.args.vocab_size} tokens) than the target "
                                  f"({target.args.vocab_size}): drafts must be the target's tokens")
    if draft.args.max_position_embeddings < engine.max_model_len:
        raise FieldError("model", f"speculative_config model {spec.model!r} handles "
                                  f"{draft.args.max_position_embeddings} positions, fewer than "
                                  f"max_model_len {engine.max_model_len}")
    draft.model.use_fused_kernels(engine.backend.name == "triton")
    pool = allocate_kv_pool(engine.block_manager.num_blocks, draft.args, engine.config.block_size,
                            engine.dtype, engine.device, engine.config.kv_cache_dtype)
    return DraftModelProposer(draft.model, pool, engine.backend, engine.block_manager, owns_kv=True)
