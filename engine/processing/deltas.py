"""From scheduler updates to what the caller sees: per-completion detokenizers (vLLM's stop
strings included), the caller's groups of completions, and one CompletionDelta per update."""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler, stop_status
from engine.processing.detokenizer import IncrementalDetokenizer
from engine.processing.outputs import CompletionDelta
from engine.processing.tokenizer import Tokenizer
from engine.processing.tokens import Logprob, SampledToken


class Deltas:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # finishes a request whose text hit a stop string
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._groups: dict[str, list[str]] = {}  # caller's id -> ids of its completions

    def forget_group(self, request_id: str) -> list[str]:
        """Stop tracking every completion of the caller's request id; their ids."""
        ids = self._groups.pop(request_id, [])
        for rid in ids:
            self._detok.pop(rid, None)
        return ids

    def new_detokenizer(self, request: Request) -> IncrementalDetokenizer:
        p = request.sampling
        detok = IncrementalDetokenizer(
            self.tokenizer,
            p.skip_special_tokens,
            p.stop,
            p.include_stop_str_in_output,
            p.min_tokens,
        )
        if request.resume is not None:
            detok.resume(request.resume.output_token_ids, request.resume.num_text_chars)
        return detok

    def track(self, request: Request, detok: IncrementalDetokenizer | None = None) -> None:
        self._groups.setdefault(request.group_id, []).append(request.request_id)
        self._detok[request.request_id] = detok or self.new_detokenizer(request)

    def build(self, updates: list[tuple[Request, int]]) -> list[CompletionDelta]:
        """Detokenize each request's new tokens (the number given; 0 = it finished without
        one), apply stop strings (a stop string inside a step's tokens drops the tokens after
        it), build deltas. The first delta of completion 0 carries the prompt logprobs (if
        asked)."""
        deltas = []
        for request, num_new in updates:
            detok = self._detok.get(request.request_id)
            if detok is None:  # a fork seen for the first time
                self.track(request)
                detok = self._detok[request.request_id]
            tokens = self._detokenize(
                request, detok, request.token_ids[-num_new:] if num_new else []
            )
            status, sampling = request.status, request.sampling
            finished = status.is_finished
            deltas.append(
                CompletionDelta(
                    request_id=request.group_id,
                    index=request.completion_index,
                    token_ids=tokens,
                    text=detok.take_delta(finished),
                    logprobs=request.logprobs[-len(tokens) :]
                    if tokens and sampling.logprobs is not None
                    else [],
                    finish_reason=status.finish_reason,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_output_tokens=request.num_output_tokens,
                    stop_reason=request.stop_reason,
                    prompt_logprobs=(
                        self._first_prompt_logprobs(request, tokens)
                        if sampling.prompt_logprobs is not None
                        else None
                    ),
                    embedding=request.embedding,
                )
            )
            if finished:
                self._forget(request)
        return deltas

    def preview_first(self, request: Request, token: SampledToken) -> CompletionDelta | None:
        """The delta `build` will make when `token` becomes the parked request's first output
        (a decode worker admitting a remote prefill: `LLMEngine.finish_remote_prefill`), made
        now without changing anything, so the token can be on its way to the caller before the
        engine's next step boundary. Any thread: it reads only what a request parked for
        remote KV never changes (prompt, sampling, limits; no outputs, no resume: see
        `Request.remote_prefill_ok`), through its own detokenizer.
        None for a request with a grammar: whether it is complete after the token is its
        matcher's verdict, which only the engine thread may advance."""
        if request.grammar is not None:
            return None
        status, stop_token = stop_status(
            request, token.token_id, 1, request.num_tokens + 1, self.scheduler.max_model_len
        )
        stop_reason: str | int | None = stop_token
        detok = self.new_detokenizer(request)
        stop = detok.append(token.token_id, status is RequestStatus.FINISHED_STOPPED)
        if stop is not None:  # as `_detokenize`: the stop string's verdict wins
            status, stop_reason = RequestStatus.FINISHED_STOPPED, stop
        sampling = request.sampling
        logprobs = (
            [Logprob(token.token_id, token.logprob, list(token.top_logprobs), token.rank)]
            if token.logprob is not None and sampling.logprobs is not None
            else []
        )
        return CompletionDelta(
            request_id=request.group_id,
            index=request.completion_index,
            token_ids=[token.token_id],
            text=detok.take_delta(status is not None),
            logprobs=logprobs,
            finish_reason=status.finish_reason if status is not None else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=1,
            stop_reason=stop_reason,
        )

    def _detokenize(
        self, request: Request, detok: IncrementalDetokenizer, tokens: list[int]
    ) -> list[int]:
        """Detokenize a step's new tokens one by one; the ones kept. A stop string ends the
        request with finish "stop" at the token completing it (tokens after it are dropped),
        even one that also hit a length limit or a stop token (vLLM: the detokenizer's
        verdict wins)."""
        for i, token_id in enumerate(tokens):
            last = i == len(tokens) - 1
            stop_terminated = last and request.status is RequestStatus.FINISHED_STOPPED
            stop = detok.append(token_id, stop_terminated)
            if stop is None:
                continue
            request.stop_reason = stop
            if not request.status.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            elif request.status is RequestStatus.FINISHED_LENGTH:
                request.status = RequestStatus.FINISHED_STOPPED
            dropped = len(tokens) - i - 1
            if dropped:
                del request.token_ids[-dropped:]
                if request.sampling.logprobs is not None:
                    del request.logprobs[-dropped:]
            return tokens[: i + 1]
        return tokens

    @staticmethod
    def _first_prompt_logprobs(request: Request, tokens: list[int]) -> list[Logprob] | None:
        if request.parent_id is not None:  # a fork: completion 0's delta carries them
            return None
        return list(request.prompt_logprobs) if tokens and request.num_output_tokens == 1 else None

    def _forget(self, request: Request) -> None:
        self._detok.pop(request.request_id, None)
        group = self._groups.get(request.group_id, [])
        if request.request_id in group:
            group.remove(request.request_id)
        if not group:
            self._groups.pop(request.group_id, None)
