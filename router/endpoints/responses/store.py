"""Finished responses kept for `previous_response_id`: a bounded, in-memory LRU in this router
process (`--enable-response-store`, `--response-store-max-entries`,
`--response-store-max-bytes`).

An entry is the conversation a response ended: the chat messages of its earlier turns, its
input and its output (never its instructions: OpenAI does not carry them over). Entries are
kept per tenant (the API key's digest, router/http/auth.py): another key's id is unknown (404),
as it would be if it did not exist. Ids are random (128 bits), never the client's.

Bounds: at most `max_entries` entries and `max_bytes` of conversation (its JSON size);
past either, the tenant holding the most (entries, or bytes, whichever bound was passed)
loses its least recently used (stored or continued) entry — so one tenant storing in a loop
evicts only its own entries once it holds the most, never every tenant's (issue 51: a fair
share, max-min). An entry larger than `max_bytes` on its own is not kept. Behind several
routers, a client continues a response on the router that answered it.
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
        self._tenants: dict[bytes | None, _Tenant] = {}

    def __len__(self) -> int:
        return sum(len(t.entries) for t in self._tenants.values())

    def held(self, tenant: bytes | None) -> tuple[int, int]:
        """(entries, bytes) `tenant` holds."""
        t = self._tenants.get(tenant)
        return (0, 0) if t is None else (len(t.entries), t.bytes)

    def get(self, tenant: bytes | None, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation `response_id` ended (None: not kept for this tenant)."""
        t = self._tenants.get(tenant)
        entry = None if t is None else t.entries.get(response_id)
        if t is None or entry is None:
            return None
        t.entries.move_to_end(response_id)
        return list(entry.conversation)

    def put(
        self, tenant: bytes | None, response_id: str, conversation: list[dict[str, Any]]
    ) -> None:
        """Keeps `conversation` (its messages are never changed afterwards: later entries
        share them)."""
        size = len(json.dumps(conversation, separators=(",", ":")))
        t = self._tenants.setdefault(tenant, _Tenant())
        old = t.entries.pop(response_id, None)
        if old is not None:
            t.bytes -= old.size
            self.bytes -= old.size
        if size <= self.max_bytes:
            t.entries[response_id] = _Entry(tuple(conversation), size)
            t.bytes += size
            self.bytes += size
        while len(self) > self.max_entries or self.bytes > self.max_bytes:
            self._evict(by_bytes=self.bytes > self.max_bytes)
        if not t.entries and self._tenants.get(tenant) is t:
            del self._tenants[tenant]

    def _evict(self, by_bytes: bool) -> None:
        """The largest holder's least recently used entry goes."""
        tenant, t = max(
            self._tenants.items(),
            key=lambda kv: kv[1].bytes if by_bytes else len(kv[1].entries),
        )
        _, entry = t.entries.popitem(last=False)
        t.bytes -= entry.size
        self.bytes -= entry.size
        if not t.entries:
            del self._tenants[tenant]


class _Tenant:
    """One tenant's entries, least recently used first, and their size."""

    __slots__ = ("entries", "bytes")

    def __init__(self) -> None:
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0
