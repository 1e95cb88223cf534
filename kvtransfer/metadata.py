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

METADATA_VERSION = 1
MEM_TYPES = ("DRAM", "VRAM")


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

    @property
    def compat_hash(self) -> str:
        return self.compat.hash()

    @property
    def block_bytes(self) -> int:
        return self.compat.block_bytes

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
        try:
            blob = base64.b64decode(_field(doc, "agent_metadata", str), validate=True)
        except (binascii.Error, ValueError) as e:
            raise MetadataError(f"peer agent_metadata is not valid base64: {e}") from e
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
        )
        meta.validate()
        return meta

    def validate(self) -> None:
        """Raise MetadataError if a field is out of its domain."""
        if not self.agent_name:
            raise MetadataError("peer metadata has an empty agent_name")
        if self.num_blocks <= 0:
            raise MetadataError(f"peer metadata num_blocks={self.num_blocks} must be positive")
        if self.base_addr <= 0 or self.base_addr + self.num_blocks * self.block_bytes >= 2**64:
            raise MetadataError(f"peer metadata base_addr={self.base_addr:#x} is out of range")
        if self.mem_type not in MEM_TYPES:
            raise MetadataError(f"peer metadata mem_type={self.mem_type!r} not in {MEM_TYPES}")
        if self.device_id < 0:
            raise MetadataError(f"peer metadata device_id={self.device_id} is negative")


def _field(doc: dict[str, Any], name: str, kind: type) -> Any:
    if name not in doc:
        raise MetadataError(f"peer metadata is missing field {name!r}")
    value = doc[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MetadataError(
            f"peer metadata field {name!r} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value
