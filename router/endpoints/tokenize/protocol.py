"""POST /tokenize and /detokenize (vLLM): request and response bodies."""

from __future__ import annotations

from router.endpoints.base import RequestModel, ResponseModel
from router.endpoints.chat.protocol import ChatMessage, ChatTool


class TokenizeRequest(RequestModel):
    """POST /tokenize (vLLM): either `prompt` or `messages` (+ the chat template fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[ChatTool] | None = None  # rendered as a chat request's tools are
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeResponse(ResponseModel):
    prompt: str
