"""POST /tokenize and /detokenize (vLLM's): a prompt or chat messages to token ids (rendered
as a chat request renders them), and back. Both need the API key when one is set
(router/http/auth.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from router.endpoints.base import parse_json
from router.endpoints.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from router.generation.chat_render import render_chat
from router.generation.chat_tools import function_tools
from router.generation.inputs import check_token_ids, encode_text, max_prompt_chars
from router.generation.prepare import check_model
from router.http.errors import bad_request
from router.http.openapi import SIDE_ERRORS, route_schema
from router.services import Services


def add_tokenize_routes(app: FastAPI, services: Services) -> None:
    card = services.card

    @app.post("/tokenize", **route_schema(TokenizeRequest, TokenizeResponse, errors=SIDE_ERRORS))
    async def tokenize(request: Request) -> Response:
        body = await request.body()
        return await services.tokenizing(
            len(body), tokenize_body, body, services.max_model_len(), services.loras.served()
        )

    def tokenize_body(body: bytes, limit: int, adapters: dict[str, str]) -> Response:
        """The response, rendered here (off the loop for a large body: 100k token ids take
        ~0.1 s to serialize)."""
        req = parse_json(TokenizeRequest, body)
        check_model(req.model, card, adapters)  # an adapter: the same tokenizer
        tok = card.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            extra = {}
            if req.tools:  # as a chat request with these tools renders them (vLLM's field)
                extra["tools"] = [t.to_openai() for t in function_tools(req.tools)]
            text = render_chat(
                tok,
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                "add_generation_prompt" in req.model_fields_set,
                extra,
            )
            special = bool(req.add_special_tokens)
        else:
            text, special = req.prompt or "", req.add_special_tokens is not False
        ids = encode_text(
            tok,
            text,
            special,
            max_prompt_chars(card, limit, services.config.limits),
            "messages" if req.messages is not None else "prompt",
        )
        out: dict[str, Any] = {"count": len(ids), "max_model_len": limit, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.token_str(t) for t in ids]
        return JSONResponse(out)

    @app.post(
        "/detokenize", **route_schema(DetokenizeRequest, DetokenizeResponse, errors=SIDE_ERRORS)
    )
    async def detokenize(request: Request) -> Response:
        body = await request.body()
        return await services.tokenizing(len(body), detokenize_body, body, services.loras.served())

    def detokenize_body(body: bytes, adapters: dict[str, str]) -> Response:
        req = parse_json(DetokenizeRequest, body)
        check_model(req.model, card, adapters)
        check_token_ids(req.tokens, card, "tokens")
        return JSONResponse({"prompt": card.tokenizer.decode(req.tokens)})
