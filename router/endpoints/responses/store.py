"""Finished responses kept for `previous_response_id`: a bounded, in-memory LRU in this router
process (`--enable-response-store`, `--response-store-max-entries`,
`--response-store-max-bytes`).

An entry is the conversation a response ended: the chat messages of its earlier turns, its
input and its output (never its instructions: OpenAI does not carry them over). Entries are
kept per tenant (the API key's digest, router/http/auth.py): another key's id is unknown (404),
as it would be if it did not exist. Ids are random (128 bits), never the client's.

Bounds: at most `max_entries` entries and `max_bytes` of conversation (its JSON size);
past either, the least recently used (stored or continued) entries go first. An entry larger
than `max_bytes` on its own is not kept. Behind several routers, a client continues a response
on the router that answered it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, NamedTuple


class _Entry(NamedTuple):
    conversation: tuple[dict[str, Any], ...]
    size: int  # its JSON's length


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[bytes | None, str], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tenant: bytes | None, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation `response_id` ended (None: not kept for this tenant)."""
        key = (tenant, response_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return list(entry.conversation)

    def put(
        self, tenant: bytes | None, response_id: str, conversation: list[dict[str, Any]]
    ) -> None:
        """Keeps `conversation` (its messages are never changed afterwards: later entries
        share them)."""
        size = len(json.dumps(conversation, separators=(",", ":")))
        key = (tenant, response_id)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        if size > self.max_bytes:
            return
        self._entries[key] = _Entry(tuple(conversation), size)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self.bytes -= self._entries.popitem(last=False)[1].size
