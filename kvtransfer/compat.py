"""What two workers must agree on before one may write KV blocks into the other's pool.

A block is copied byte for byte, so both pools must hold the same model's KV in the same dtype
and the same block-major layout:

    kv_cache.shape == [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Only `num_blocks` (and the device) may differ between peers. This module imports no torch so
that the router can compute and compare compatibility hashes cheaply.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvtransfer.errors import IncompatiblePeerError, MetadataError, PoolError

#: The only pool layout this version knows; part of the hash so that a future layout change
#: refuses old peers instead of scrambling their KV.
BLOCK_MAJOR_LAYOUT = "block-major:[num_blocks,num_layers,2,block_size,num_kv_heads,head_dim]"

_DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def normalize_dtype(dtype: object) -> str:
    """'torch.bfloat16', torch.bfloat16 or 'bfloat16' -> 'bfloat16'."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; known: {sorted(_DTYPE_SIZES)}")
    return name


@dataclass(frozen=True, slots=True)
class KVCompat:
    """The KV layout a worker's pool holds; equal descriptors mean blocks are interchangeable."""

    model_id: str
    """Model identity (name + revision, or a weights hash): KV of two models never mixes."""
    dtype: str
    """Element type of the pool, normalized ('float32', 'bfloat16', ...)."""
    block_size: int
    """Tokens per block."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = BLOCK_MAJOR_LAYOUT
    """Dimension order of the pool tensor; see the module docstring."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError("model_id must be a non-empty string")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: `kv_cache.shape[1:]`."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def element_size(self) -> int:
        return _DTYPE_SIZES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (all layers, K and V): the size of one transfer descriptor."""
        n = self.element_size
        for d in self.block_shape:
            n *= d
        return n

    def hash(self) -> str:
        """Stable hex digest over every field (published in etcd; compared by the router)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> KVCompat:
        if not isinstance(data, dict):
            raise MetadataError(f"compat descriptor must be an object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        missing = names - data.keys()
        unknown = data.keys() - names
        if missing or unknown:
            raise MetadataError(
                f"compat descriptor fields: missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        try:
            return cls(**data)
        except (TypeError, ValueError) as e:
            raise MetadataError(f"invalid compat descriptor: {e}") from e

    @classmethod
    def for_pool(cls, kv_cache: Any, model_id: str) -> KVCompat:
        """The descriptor of an existing pool tensor (checks that it is 6-D)."""
        shape = tuple(kv_cache.shape)
        if len(shape) != 6 or shape[2] != 2:
            raise PoolError(
                f"KV pool must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got shape {list(shape)}"
            )
        _, layers, _, block_size, heads, head_dim = shape
        return cls(model_id, normalize_dtype(kv_cache.dtype), block_size, layers, heads, head_dim)

    def check_pool(self, kv_cache: Any) -> None:
        """Raise PoolError unless `kv_cache` is a contiguous pool of exactly this layout."""
        shape = tuple(kv_cache.shape)
        if len(shape) != 6 or shape[1:] != self.block_shape:
            raise PoolError(
                f"KV pool shape {list(shape)} does not match [num_blocks, "
                f"{', '.join(map(str, self.block_shape))}] of {self.model_id}"
            )
        if normalize_dtype(kv_cache.dtype) != self.dtype:
            raise PoolError(f"KV pool dtype {kv_cache.dtype} != compat dtype {self.dtype}")
        if not kv_cache.is_contiguous():
            raise PoolError("KV pool must be contiguous (one block = one contiguous region)")
        if shape[0] <= 0:
            raise PoolError("KV pool has no blocks")


def check_compatible(local: KVCompat, remote: KVCompat, peer: str = "peer") -> None:
    """Raise IncompatiblePeerError naming every field that differs between the two pools."""
    if local == remote:
        return
    diffs = [
        f"{f.name}: ours={getattr(local, f.name)!r} theirs={getattr(remote, f.name)!r}"
        for f in fields(KVCompat)
        if getattr(local, f.name) != getattr(remote, f.name)
    ]
    raise IncompatiblePeerError(
        f"refusing KV transfer with {peer}: incompatible KV layout ({'; '.join(diffs)})"
    )
