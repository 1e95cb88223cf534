"""Protobuf <-> engine types, in one place (servicers stay thin: from_pb -> domain -> to_pb)."""

from __future__ import annotations

import json
from typing import Any

import grpc

from engine.lora.request import LoRARequest, lora_id_for
from engine.processing.outputs import CompletionDelta
from engine.processing.tokens import Logprob, Resume, SampledToken
from engine.sampling.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputsParams
from proto import pdserve_pb2 as pb


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (naming the field) for out-of-range values."""
    return SamplingParams(
        n=m.n or 1,
        temperature=m.temperature,
        top_k=m.top_k,
        top_p=m.top_p or 1.0,
        min_p=m.min_p,
        seed=m.seed if m.HasField("seed") else None,
        presence_penalty=m.presence_penalty,
        frequency_penalty=m.frequency_penalty,
        repetition_penalty=m.repetition_penalty or 1.0,
        max_tokens=m.max_tokens if m.HasField("max_tokens") else None,
        min_tokens=m.min_tokens,
        stop=tuple(m.stop),
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
        skip_special_tokens=m.skip_special_tokens,
        include_stop_str_in_output=m.include_stop_str_in_output,
        logit_bias=dict(m.logit_bias) or None,
        allowed_token_ids=tuple(m.allowed_token_ids) or None,
        bad_words=tuple(m.bad_words),
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        truncate_prompt_tokens=m.truncate_prompt_tokens
        if m.HasField("truncate_prompt_tokens")
        else None,
        structured_outputs=(
            structured_from_pb(m.structured_outputs) if m.HasField("structured_outputs") else None
        ),
    )


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(
        n=p.n,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        min_tokens=p.min_tokens,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        logit_bias=p.logit_bias or {},
        allowed_token_ids=list(p.allowed_token_ids or ()),
        bad_words=list(p.bad_words),
    )
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        value = getattr(p, name)
        if value is not None:
            setattr(m, name, value)
    if p.structured_outputs is not None:
        m.structured_outputs.CopyFrom(structured_to_pb(p.structured_outputs))
    return m


_FLAGS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
_MARKERS = ("reasoning_start", "reasoning_end")  # token ids; empty on the wire: None


def structured_from_pb(m: pb.StructuredOutputs) -> StructuredOutputsParams:
    """A JSON schema stays JSON text (the engine parses it). Raises ValueError (FieldError)
    when no constraint is set."""
    kind = m.WhichOneof("constraint")
    kwargs: dict[str, Any] = {f: getattr(m, f) for f in _FLAGS}
    kwargs.update({f: tuple(getattr(m, f)) or None for f in _MARKERS})
    if kind == "choice":
        kwargs[kind] = tuple(m.choice.values)
    elif kind:
        kwargs[kind] = getattr(m, kind)
    return StructuredOutputsParams(**kwargs)


def structured_to_pb(p: StructuredOutputsParams) -> pb.StructuredOutputs:
    fields: dict[str, Any] = {f: getattr(p, f) for f in _FLAGS}
    fields.update({f: getattr(p, f) or () for f in _MARKERS})
    m = pb.StructuredOutputs(**fields)
    kind, value = p.kind, getattr(p, p.kind)
    if kind == "choice":
        m.choice.values.extend(value)
    elif kind == "json" and not isinstance(value, str):
        m.json = json.dumps(value)
    else:
        setattr(m, kind, value)
    return m


def logprob_to_pb(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_pb(m: pb.TokenLogprob) -> Logprob:
    return Logprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top], m.rank)


def sampled_to_pb(token: SampledToken) -> pb.TokenLogprob:
    m = pb.TokenLogprob(
        token_id=token.token_id,
        rank=token.rank,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in token.top_logprobs],
    )
    if token.logprob is not None:
        m.logprob = token.logprob
    return m


class TokenOutOfRange(ValueError):
    """A peer sent a token id outside the model's vocabulary."""


def sampled_from_pb(
    m: pb.TokenLogprob, with_logprobs: bool, vocab_size: int | None = None
) -> SampledToken:
    """The token a peer sampled. With `vocab_size` (the model's, from the engine), every
    token id in it (the token and its top alternatives) is checked to lie in
    [0, vocab_size): TokenOutOfRange otherwise — a peer's reply is never trusted to index
    the vocabulary."""
    if vocab_size is not None:
        for token_id in (m.token_id, *(t.token_id for t in m.top)):
            if not 0 <= token_id < vocab_size:
                raise TokenOutOfRange(
                    f"token id {token_id} is outside the vocabulary [0, {vocab_size})"
                )
    if not with_logprobs:
        return SampledToken(m.token_id)
    return SampledToken(
        m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top), m.rank
    )


def peer_reply_error(message: str) -> grpc.aio.AioRpcError:
    """A peer's reply that cannot be used (a token out of range), as the failed call it
    amounts to: INTERNAL with `message`."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), details=message
    )


def delta_to_pb(
    d: CompletionDelta, prefill_mode: str, remote_cached_tokens: int = 0
) -> pb.GenerateResponse:
    """`remote_cached_tokens`: the prefill worker's own prefix hit; usage reports the larger
    of the two workers' hits (neither recomputed them), never their sum."""
    m = pb.GenerateResponse(
        index=d.index,
        token_ids=d.token_ids,
        text=d.text,
        logprobs=[logprob_to_pb(lp) for lp in d.logprobs],
        finish_reason=d.finish_reason or "",
        usage=pb.Usage(
            prompt_tokens=d.num_prompt_tokens,
            completion_tokens=d.num_output_tokens,
            cached_tokens=min(d.num_prompt_tokens, max(d.num_cached_tokens, remote_cached_tokens)),
        ),
        prefill_mode=prefill_mode,
        prompt_logprobs=[logprob_to_pb(lp) for lp in d.prompt_logprobs or ()],
    )
    if isinstance(d.stop_reason, str):
        m.stop_str = d.stop_reason
    elif d.stop_reason is not None:
        m.stop_token_id = d.stop_reason
    return m


def stop_reason_from_pb(m: pb.GenerateResponse) -> str | int | None:
    """The stop string or token id that ended a completion; None for EOS (or not stopped)."""
    which = m.WhichOneof("stop_reason")
    return None if which is None else getattr(m, which)


def resume_from_pb(m: pb.GenerateRequest) -> Resume | None:
    """A migrated request's outputs so far (None: a fresh request)."""
    if not m.resume_output_token_ids:
        return None
    return Resume(tuple(m.resume_output_token_ids), m.resume_text_chars)


def lora_from_pb(m: pb.LoRAAdapter) -> LoRARequest:
    """The engine's LoRARequest; the id is `lora_id_for(name)` in every process. Raises
    ValueError for an empty name."""
    if not m.name:
        raise ValueError("lora.name must not be empty")
    return LoRARequest(m.name, lora_id_for(m.name), m.path)


def lora_to_pb(lora: LoRARequest) -> pb.LoRAAdapter:
    return pb.LoRAAdapter(name=lora.lora_name, path=lora.lora_path)


def request_lora(m: pb.GenerateRequest | pb.PrefillRequest) -> LoRARequest | None:
    """The adapter a Generate / Prefill request runs with (None: the base model)."""
    return lora_from_pb(m.lora) if m.HasField("lora") else None
