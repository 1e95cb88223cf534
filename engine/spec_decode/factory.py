"""Build the proposer a speculative_config asks for, checking it against the target model:
every mistake is an error when the engine starts, never a silent fallback."""

from __future__ import annotations

import torch

from engine.attention.selector import fused_kernels
from engine.checks import FieldError
from engine.kv.kv_pool import allocate_kv_pool
from engine.models.loader import LoadedModel, load_model
from engine.runner.model_runner import ModelRunner
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer

_PROBE_TEXT = 'Speculative decoding drafts tokens: 123, ünïcödé, {"json": true}\n'


def make_proposer(
    spec: SpeculativeConfig | None,
    target: LoadedModel,
    runner: ModelRunner,
    dtype: torch.dtype,
    max_model_len: int,
    kv_cache_dtype: str,
) -> Proposer | None:
    """`runner`: the target's — a drafter shares its attention backend, block manager and
    sampler, and `self:N` its KV pool; a separate draft model gets a pool of its own, of
    `kv_cache_dtype`, with the same block ids, its weights in `dtype`."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    layers = spec.self_draft_layers
    if layers is not None:
        if layers >= target.args.n_layers:
            raise FieldError(
                "model",
                f"speculative_config model self:{layers} must use fewer "
                f"layers than the target's {target.args.n_layers}",
            )
        return DraftModelProposer(
            target.model,
            runner.kv_cache,
            runner.backend,
            runner.bm,
            runner.sampler,
            num_layers=layers,
        )
    if runner.bm.num_groups > 1:
        raise FieldError(
            "model",
            f"speculative_config model {spec.model!r}: a separate draft "
            "model is not supported for a target whose layers mix sliding "
            "and full attention (use self:N or ngram)",
        )
    assert spec.model is not None  # draft_model: SpeculativeConfig checks it names one
    draft = load_model(spec.model, dtype, runner.device)
    if draft.args.vocab_size != target.args.vocab_size or draft.tokenizer.encode(
        _PROBE_TEXT
    ) != target.tokenizer.encode(_PROBE_TEXT):
        raise FieldError(
            "model",
            f"speculative_config model {spec.model!r} has another vocabulary "
            f"({draft.args.vocab_size} tokens) than the target "
            f"({target.args.vocab_size}): drafts must be the target's tokens",
        )
    if draft.args.max_position_embeddings < max_model_len:
        raise FieldError(
            "model",
            f"speculative_config model {spec.model!r} handles "
            f"{draft.args.max_position_embeddings} positions, fewer than "
            f"max_model_len {max_model_len}",
        )
    draft.model.use_fused_kernels(fused_kernels(runner.backend.name, runner.device))
    pool = allocate_kv_pool(
        runner.bm.pool.num_blocks,
        draft.args,
        runner.block_size,
        dtype,
        runner.device,
        kv_cache_dtype,
    )
    return DraftModelProposer(
        draft.model, pool, runner.backend, runner.bm, runner.sampler, owns_kv=True
    )
