"""Tokenizer (HF `tokenizers`) and chat-template rendering (jinja2, the template shipped with
the model). Stateless after construction; safe to share between threads."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered with the model's chat template."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


@dataclass(frozen=True)
class SpecialTokens:
    bos: str | None
    eos: str | None
    pad: str | None
    unk: str | None


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class Tokenizer:
    """Encodes/decodes text and renders chat conversations for one model."""

    def __init__(
        self,
        tokenizer_json: str,
        tokenizer_config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
    ) -> None:
        self._tok = _HFTokenizer.from_str(tokenizer_json)
        cfg = tokenizer_config
        self.special = SpecialTokens(
            bos=_token_text(cfg.get("bos_token")),
            eos=_token_text(cfg.get("eos_token")),
            pad=_token_text(cfg.get("pad_token")),
            unk=_token_text(cfg.get("unk_token")),
        )
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.chat_template: str | None = cfg.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self.token_id(self.special.eos) if self.special.eos else None
        self.bos_token_id = self.token_id(self.special.bos) if self.special.bos else None
        # Ids that end generation: the tokenizer's eos plus generation_config's eos list.
        stop = set() if self.eos_token_id is None else {self.eos_token_id}
        gen_eos = (generation_config or {}).get("eos_token_id")
        stop.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self.stop_token_ids: frozenset[int] = frozenset(stop)
        self.generation_config: dict[str, Any] = dict(generation_config or {})
        """The model's generation_config.json (engine.processing.generation_config reads its
        defaults)."""
        added = self._tok.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._added_ids = frozenset(added)
        self._template = (
            _environment().from_string(self.chat_template) if self.chat_template else None
        )
        spec = json.loads(tokenizer_json)
        decoder = spec.get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel" or any(
            d.get("type") == "ByteLevel" for d in decoder.get("decoders", ())
        )
        # SentencePiece-style BPE (Gemma, LLaMA 2): `<0xE2>` tokens are raw bytes, `▁` a space.
        self._byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))

    def set_chat_template(self, template: str) -> None:
        """Use `template` instead of the model's own (the router's --chat-template). Raises
        ChatTemplateError when it is not valid Jinja."""
        try:
            compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
        self.chat_template, self._template = template, compiled

    def template_mentions(self, name: str) -> bool:
        """Whether the chat template reads `name` at all: as a variable (`tools`), an
        attribute or key (`message.tool_calls`, `message['tool_call_id']`) or a compared
        string (`message.role == 'tool'`). What a template never mentions it cannot render,
        so a request that needs it is refused instead of rendered differently."""
        if self.chat_template is None:
            return False
        return name in _template_names(self.chat_template)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Tokenizer":
        gen_path = model_dir / "generation_config.json"
        cfg_path = model_dir / "tokenizer_config.json"
        return cls(
            (model_dir / "tokenizer.json").read_text(),
            json.loads(cfg_path.read_text()) if cfg_path.is_file() else {},
            json.loads(gen_path.read_text()) if gen_path.is_file() else None,
        )

    def token_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return token_id

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_str(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` (e.g. `Ġhello` in a byte-level vocabulary)."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            raise KeyError(f"token id {token_id} is not in the vocabulary")
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for. A byte-level BPE token can hold part of a
        multi-byte character (`decode([id])` then gives U+FFFD); these are its real bytes, so
        the bytes of a sequence's tokens, joined, are the UTF-8 of its decoded text."""
        if token_id in self._added_ids:  # added tokens: plain text
            return self.decode([token_id]).encode()
        if self._byte_level:
            return bytes(_UNICODE_TO_BYTE[c] for c in self.token_str(token_id))
        if self._byte_fallback:
            token = self.token_str(token_id)
            if _BYTE_TOKEN.fullmatch(token):
                return bytes([int(token[3:5], 16)])
            return token.replace("\u2581", " ").encode()
        return self.decode([token_id]).encode()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token text (e.g. `<|im_start|>`) maps to its id.
        Releases the GIL while it runs (`encode_batch` does, `encode` does not: an 8 MB text
        held every other thread for 7 s), so a thread tokenizing a long text stalls nobody."""
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_step(self, stream: DecodeStream, token_id: int) -> str | None:
        """The text `token_id` adds to what `stream` decoded so far; None while it ends in
        an incomplete character."""
        return stream.step(self._tok, token_id)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The model's chat template applied to `messages`, as text. `extra` are further
        template variables (`chat_template_kwargs`); they cannot replace `messages` or the two
        flags. `continue_final_message`: the text ends right after the last message's content
        (no end-of-turn marker), so the model continues that message (as HF transformers)."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        context = {
            "bos_token": self.special.bos or "",
            "eos_token": self.special.eos or "",
            "pad_token": self.special.pad or "",
            "unk_token": self.special.unk or "",
            **extra,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        try:
            text = self._template.render(**context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        if not continue_final_message:
            return text
        final = messages[-1].get("content") or "" if messages else ""
        # Some templates strip message text: fall back to the stripped content.
        for needle in (final, final.strip()):
            at = text.rfind(needle) if needle else -1
            if at >= 0:
                return text[: at + len(needle)]
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the rendered chat"
        )

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} form of tokenizer_config.json
        return value.get("content")
    return value


@functools.lru_cache(maxsize=8)
def _template_names(template: str) -> frozenset[str]:
    """Every variable, attribute, constant key and string constant in a template's syntax."""
    from jinja2 import nodes

    names = set()
    for node in _environment().parse(template).find_all((nodes.Name, nodes.Getattr, nodes.Const)):
        value = (
            node.name
            if isinstance(node, nodes.Name)
            else node.attr
            if isinstance(node, nodes.Getattr)
            else node.value
            if isinstance(node, nodes.Const)
            else None
        )
        if isinstance(value, str):
            names.add(value)
    return frozenset(names)


def _environment() -> ImmutableSandboxedEnvironment:
    # The same rendering rules HF uses for chat templates.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
    return env
