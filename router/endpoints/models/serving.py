"""The model-information endpoints beside generation (vLLM's): /v1/models[/{id}], /tokenize,
/detokenize, /version. /v1/*, /tokenize and /detokenize need the API key when one is set
(router/http/auth.py); /version does not (as vLLM)."""
from __future__ import annotations

import importlib.metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from router.generation.chat_tools import function_tools
from router.http.errors import bad_request
from router.http.openapi import SIDE_ERRORS, route_schema
from router.endpoints.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from router.endpoints.base import parse_json
from router.endpoints.tokenize.protocol import DetokenizeResponse, TokenizeResponse
from router.endpoints.models.protocol import ModelInfo, ModelList, VersionResponse
from router.services import Services
from router.generation.chat_render import render_chat
from router.generation.prepare import check_model, check_token_ids, encode_text, max_prompt_chars


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_info_routes(app: FastAPI, services: Services) -> None:
    card, version = services.card, _version()

    def model_card(lora_name: str | None = None, lora_path: str = "") -> dict[str, Any]:
        """The base model's card, or (vLLM's) a LoRA adapter's: `parent` the base model,
        `root` the adapter's path."""
        if lora_name is None:
            return {"id": card.name, "object": "model", "created": 0, "owned_by": "pdserve",
                    "root": card.name, "parent": None, "max_model_len": services.max_model_len()}
        return {"id": lora_name, "object": "model", "created": 0, "owned_by": "pdserve",
                "root": lora_path, "parent": card.name, "max_model_len": services.max_model_len()}

    @app.get("/v1/models", **route_schema(ok=ModelList, errors=(401, 500)))
    async def models() -> dict[str, Any]:
        loras = sorted(services.loras.served().items())
        return {"object": "list", "data": [model_card(), *(model_card(n, p) for n, p in loras)]}

    @app.get("/v1/models/{model_id:path}", **route_schema(ok=ModelInfo, errors=(401, 404, 500)))
    async def model(model_id: str) -> dict[str, Any]:
        lora = check_model(model_id, card, services.loras.served())
        return model_card(*(lora.lora_name, lora.lora_path) if lora else ())

    @app.get("/version", **route_schema(ok=VersionResponse, errors=(500,)))
    async def get_version() -> dict[str, str]:
        return {"version": version}

    @app.post("/tokenize", **route_schema(TokenizeRequest, TokenizeResponse, errors=SIDE_ERRORS))
    async def tokenize(request: Request) -> Response:
        body = await request.body()
        return await services.tokenizing(len(body), tokenize_body, body, services.max_model_len(),
                                         services.loras.served())

    def tokenize_body(body: bytes, limit: int, adapters: dict[str, str]) -> Response:
        """The response, rendered here (off the loop for a large body: 100k token ids take
        ~0.1 s to serialize)."""
        req = parse_json(TokenizeRequest, body)
        check_model(req.model, card, adapters)  # an adapter: the same tokenizer
        tok = card.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            kwargs = dict(req.chat_template_kwargs or {})
            if req.tools:  # as a chat request with these tools renders them (vLLM's field)
                kwargs["tools"] = [t.to_openai() for t in function_tools(req.tools)]
            text = render_chat(tok, req.messages, req.add_generation_prompt,
                               req.continue_final_message, kwargs,
                               "add_generation_prompt" in req.model_fields_set)
            special = bool(req.add_special_tokens)
        else:
            text, special = req.prompt, req.add_special_tokens is not False
        ids = encode_text(tok, text, special, max_prompt_chars(card, limit, services.config.limits),
                          "messages" if req.messages is not None else "prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": limit, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.token_str(t) for t in ids]
        return JSONResponse(out)

    @app.post("/detokenize", **route_schema(DetokenizeRequest, DetokenizeResponse,
                                            errors=SIDE_ERRORS))
    async def detokenize(request: Request) -> Response:
        body = await request.body()
        return await services.tokenizing(len(body), detokenize_body, body, services.loras.served())

    def detokenize_body(body: bytes, adapters: dict[str, str]) -> Response:
        req = parse_json(DetokenizeRequest, body)
        check_model(req.model, card, adapters)
        check_token_ids(req.tokens, card, "tokens")
        return JSONResponse({"prompt": card.tokenizer.decode(req.tokens)})
