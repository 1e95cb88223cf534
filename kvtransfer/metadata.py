"""The identity a worker publishes so that peers can write into its KV pool.

It travels as bytes (gRPC field, etcd value): UTF-8 JSON with the backend's opaque blob in
base64. `from_bytes` validates everything it reads and raises MetadataError, never anything
else, so a corrupt etcd value cannot crash a worker.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from kvtransfer.compat import KVCompat
from kvtransfer.errors import MetadataError
from kvtransfer.heads import HeadRange, PoolGeometry, check_ranges

METADATA_VERSION = 1
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, slots=True)
class RankPool:
    """The pool of one more rank of a tensor-parallel worker (ranks 1..N-1; rank 0's is the
    metadata's own): its own NIXL agent, the heads it holds, where it is."""

    agent_name: str
    heads: HeadRange
    base_addr: int
    device_id: int
    agent_metadata: bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent_name": self.agent_name,
            "heads": [self.heads.start, self.heads.stop],
            "base_addr": self.base_addr,
            "device_id": self.device_id,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
        }

    @classmethod
    def from_dict(cls, doc: object) -> RankPool:
        if not isinstance(doc, dict):
            raise MetadataError("peer metadata ranks[] entries must be objects")
        return cls(
            _field(doc, "agent_name", str),
            _heads(doc.get("heads")),
            _field(doc, "base_addr", int),
            _field(doc, "device_id", int),
            _b64(_field(doc, "agent_metadata", str)),
        )


@dataclass(frozen=True, slots=True)
class PeerMetadata:
    """Everything a sender needs to reach a receiver's pool."""

    agent_name: str
    """Unique name of the worker's transfer agent (NIXL agent name)."""
    backend: str
    """'nixl' or 'fake'; a backend refuses metadata of another backend."""
    compat: KVCompat
    """Layout of the pool; checked before any transfer."""
    num_blocks: int
    """Blocks in the pool; remote block ids must be below this."""
    base_addr: int
    """Address of block 0; block b starts at base_addr + b * compat.block_bytes."""
    mem_type: str
    """'DRAM' (CPU tensor) or 'VRAM' (CUDA tensor)."""
    device_id: int
    """CUDA device index for VRAM, 0 for DRAM."""
    agent_metadata: bytes = b""
    """Opaque backend blob (NIXL: connection info + memory registration keys)."""
    version: int = METADATA_VERSION
    heads: HeadRange | None = None
    """The KV heads this pool (rank 0's) holds; None: all of them (tensor_parallel_size 1)."""
    ranks: tuple[RankPool, ...] = ()
    """A tensor-parallel worker's other ranks' pools (same block ids); () at size 1. Neither
    field is written at size 1, so a single-process worker's metadata is as before."""

    @property
    def compat_hash(self) -> str:
        return self.compat.hash()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the whole layout (every head), as counted in metrics."""
        return self.compat.block_bytes

    @property
    def head_range(self) -> HeadRange:
        return self.heads or HeadRange(0, self.compat.num_kv_heads)

    def head_ranges(self) -> list[HeadRange]:
        """The heads of each rank's pool, rank 0 first."""
        return [self.head_range, *(r.heads for r in self.ranks)]

    def geometry(self, rank: int = 0) -> PoolGeometry:
        """Rank `rank`'s pool, for descriptors."""
        c = self.compat
        heads, base, device = (
            (self.head_range, self.base_addr, self.device_id)
            if rank == 0
            else (
                self.ranks[rank - 1].heads,
                self.ranks[rank - 1].base_addr,
                self.ranks[rank - 1].device_id,
            )
        )
        return PoolGeometry(
            base,
            heads.count,
            device,
            c.num_layers * 2 * c.block_size,
            c.stored_head_dim * c.element_size,
        )

    def to_bytes(self) -> bytes:
        doc = {
            "version": self.version,
            "agent_name": self.agent_name,
            "backend": self.backend,
            "compat": self.compat.to_dict(),
            "compat_hash": self.compat_hash,
            "num_blocks": self.num_blocks,
            "base_addr": self.base_addr,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode("ascii"),
        }
        if self.heads is not None or self.ranks:
            doc["heads"] = [self.head_range.start, self.head_range.stop]
            doc["ranks"] = [r.to_dict() for r in self.ranks]
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PeerMetadata:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise MetadataError(f"peer metadata must be bytes, got {type(data).__name__}")
        try:
            doc = json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MetadataError(f"peer metadata is not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise MetadataError("peer metadata must be a JSON object")
        version = _field(doc, "version", int)
        if version != METADATA_VERSION:
            raise MetadataError(
                f"peer metadata version {version} is not supported (expected {METADATA_VERSION})"
            )
        compat = KVCompat.from_dict(doc.get("compat"))
        claimed = _field(doc, "compat_hash", str)
        if claimed != compat.hash():
            raise MetadataError("peer metadata compat_hash does not match its compat descriptor")
        blob = _b64(_field(doc, "agent_metadata", str))
        ranks = doc.get("ranks", [])
        if not isinstance(ranks, list):
            raise MetadataError("peer metadata field 'ranks' must be a list")
        meta = cls(
            agent_name=_field(doc, "agent_name", str),
            backend=_field(doc, "backend", str),
            compat=compat,
            num_blocks=_field(doc, "num_blocks", int),
            base_addr=_field(doc, "base_addr", int),
            mem_type=_field(doc, "mem_type", str),
            device_id=_field(doc, "device_id", int),
            agent_metadata=blob,
            version=version,
            heads=_heads(doc["heads"]) if "heads" in doc else None,
            ranks=tuple(RankPool.from_dict(r) for r in ranks),
        )
        meta.validate()
        return meta

    def validate(self) -> None:
        """Raise MetadataError if a field is out of its domain."""
        if not self.agent_name:
            raise MetadataError("peer metadata has an empty agent_name")
        if self.num_blocks <= 0:
            raise MetadataError(f"peer metadata num_blocks={self.num_blocks} must be positive")
        for rank in range(len(self.ranks) + 1):
            pool = self.geometry(rank)
            if pool.base_addr <= 0 or pool.base_addr + self.num_blocks * pool.block_bytes >= 2**64:
                raise MetadataError(
                    f"peer metadata base_addr={pool.base_addr:#x} (rank {rank}) is out of range"
                )
        try:
            check_ranges(self.head_ranges(), self.compat.num_kv_heads)
        except ValueError as e:
            raise MetadataError(f"peer metadata head ranges: {e}") from e
        names = [self.agent_name, *(r.agent_name for r in self.ranks)]
        if len(set(names)) != len(names) or not all(names):
            raise MetadataError(f"peer metadata rank agent names must be distinct: {names}")
        if self.mem_type not in MEM_TYPES:
            raise MetadataError(f"peer metadata mem_type={self.mem_type!r} not in {MEM_TYPES}")
        if self.device_id < 0:
            raise MetadataError(f"peer metadata device_id={self.device_id} is negative")


def _heads(value: object) -> HeadRange:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise MetadataError(f"peer metadata heads must be [start, stop], got {value!r}")
    return HeadRange(*value)


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MetadataError(f"peer agent_metadata is not valid base64: {e}") from e


def _field(doc: dict[str, Any], name: str, kind: type) -> Any:
    if name not in doc:
        raise MetadataError(f"peer metadata is missing field {name!r}")
    value = doc[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MetadataError(
            f"peer metadata field {name!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value
