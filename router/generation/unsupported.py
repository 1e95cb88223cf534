"""Request fields pdserve does not act on: the vLLM ones whose effect it lacks
(router/endpoints/sampling.py: `LACKING`) are a 400 naming the field, so a client moving from
vLLM never gets a silent difference. Any other unknown field is ignored with one warning per
field name (the one policy of every request body: router/endpoints/base.py)."""

from __future__ import annotations

from router.endpoints.chat.protocol import ChatCompletionRequest
from router.endpoints.completions.protocol import CompletionRequest
from router.endpoints.sampling import LACKING
from router.http.errors import bad_request


def refuse_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
    else:
        if (req.model_extra or {}).get("echo"):
            raise bad_request("echo is not supported for chat completions", "echo")
    for name, value in (req.model_extra or {}).items():
        lacking = LACKING.get(name)
        if lacking is not None and lacking(value):
            raise bad_request(f"{name} is not supported by this server", name)
