"""Wire format of the notifications that ride on batch writes.

Every batch write carries one notification, delivered by the transport only after the batch's
data is in the receiver's pool. It names the request, the batch's sequence number and the
remote block ids it wrote; the final one also carries the request's total block count, which
the receiver checks against what it expected and what landed.

    b"pdkv1:" + JSON {"r": request_id, "s": seq, "b": [block ids], "n": total (final only)}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

MAGIC = b"pdkv1:"
#: Sent once when a peer is added, to set the connection up before the first request.
HELLO = MAGIC + b"hello"


@dataclass(frozen=True, slots=True)
class BatchNotice:
    request_id: str
    seq: int
    blocks: tuple[int, ...]
    total: int | None = None
    """Total blocks of the request; set on the final batch only."""

    @property
    def final(self) -> bool:
        return self.total is not None

    def encode(self) -> bytes:
        doc: dict[str, object] = {"r": self.request_id, "s": self.seq, "b": list(self.blocks)}
        if self.total is not None:
            doc["n"] = self.total
        return MAGIC + json.dumps(doc, separators=(",", ":")).encode()


def decode(msg: bytes) -> BatchNotice | None:
    """The notice in `msg`; None for HELLO. Raises ValueError for anything malformed."""
    if msg == HELLO:
        return None
    if not msg.startswith(MAGIC):
        raise ValueError("not a pdserve KV notification")
    try:
        doc = json.loads(msg[len(MAGIC) :].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed KV notification: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError("malformed KV notification: not an object")
    rid, seq, blocks, total = doc.get("r"), doc.get("s"), doc.get("b"), doc.get("n")
    if not isinstance(rid, str) or not _is_int(seq) or not isinstance(blocks, list):
        raise ValueError("malformed KV notification: bad r/s/b fields")
    if not all(_is_int(b) for b in blocks) or (total is not None and not _is_int(total)):
        raise ValueError("malformed KV notification: non-integer block id or total")
    return BatchNotice(rid, seq, tuple(blocks), total)


def _is_int(x: object) -> TypeIs[int]:
    return isinstance(x, int) and not isinstance(x, bool)
