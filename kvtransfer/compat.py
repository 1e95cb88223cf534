"""What two workers must agree on before one may write KV blocks into the other's pool.

A block is copied byte for byte, so both pools must hold the same model's KV in the same
storage format (element type and scale layout) and the same block-major layout, heads first
inside a block (so a range of heads of a block is one region, kvtransfer/heads.py):

    kv_cache.shape == [num_blocks, num_kv_heads, num_layers, 2, block_size, stored_head_dim]

where `num_layers` is the layers one block holds: all of them, or one KV group's when the
model mixes sliding and full attention (engine/kv/kv_groups.py: then a request has a table per
group, and the destination block ids list each group's blocks after the skip, group after
group). `layer_windows` fixes the grouping. Only `num_blocks` (and the device) may differ
between peers. A quantized KV cache (vLLM's
`kv_cache_dtype`, engine/kv/kv_format.py) changes what a block's bytes mean:

| kv_cache_dtype | pool dtype    | stored_head_dim | scale layout |
|---|---|---|---|
| auto           | model dtype   | head_dim        | none |
| fp8_e4m3       | float8_e4m3fn | head_dim        | unit (scale 1, nothing stored) |
| fp8_e5m2       | float8_e5m2   | head_dim        | unit |
| int8           | int8          | head_dim + 4    | float32 per token and kv head: last 4 bytes |

The scales live inside the block, so a block is still one contiguous region: moving its bytes
moves its scales. Two pools of different formats are refused (`check_compatible`), never
reinterpreted — an int8 block read as fp8 is noise. This module imports no torch so that the
router can compute and compare compatibility hashes cheaply.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvtransfer.errors import IncompatiblePeerError, MetadataError, PoolError

#: The only pool layout this version knows; part of the hash so that a layout change refuses
#: peers of the other layout by name (`layout: ours=... theirs=...`) instead of scrambling
#: their KV. The layout before heads came first inside a block was
#: "block-major:[num_blocks,num_layers,2,block_size,num_kv_heads,head_dim]" (`OLD_LAYOUTS`).
BLOCK_MAJOR_LAYOUT = "block-major-hnd:[num_blocks,num_kv_heads,num_layers,2,block_size,head_dim]"
OLD_LAYOUTS = ("block-major:[num_blocks,num_layers,2,block_size,num_kv_heads,head_dim]",)

_DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


#: kv_cache_dtype -> (pool dtype, bytes of scales after head_dim, scale layout). The layout
#: strings are part of the hash: a future encoding gets a new string and refuses old peers.
_KV_FORMATS = {
    "fp8_e4m3": ("float8_e4m3fn", 0, "unit"),
    "fp8_e5m2": ("float8_e5m2", 0, "unit"),
    "int8": ("int8", 4, "per-token-head:float32-after-head_dim"),
}
_AUTO_DTYPES = ("float32", "bfloat16", "float16")  # what `auto` (the model dtype) may be


def normalize_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """vLLM's names -> one per format ('fp8' is 'fp8_e4m3')."""
    name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    if name != "auto" and name not in _KV_FORMATS:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}; known: auto, fp8, {', '.join(_KV_FORMATS)}"
        )
    return name


def scale_layout_for(kv_cache_dtype: str) -> str:
    name = normalize_kv_cache_dtype(kv_cache_dtype)
    return "none" if name == "auto" else _KV_FORMATS[name][2]


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
    """The model's head dim: values per token and kv head (without int8's scale bytes)."""
    kv_cache_dtype: str = "auto"
    """How values are stored (normalized vLLM name: auto, fp8_e4m3, fp8_e5m2, int8)."""
    scale_layout: str = ""
    """Where the dequantization scales are; '' = this version's layout for kv_cache_dtype
    (see the module docstring). Published, compared and hashed like every field."""
    layout: str = BLOCK_MAJOR_LAYOUT
    """Dimension order of the pool tensor; see the module docstring."""
    architecture: str = ""
    """config.json's `architectures[0]`: two architectures' KV never mixes, whatever the
    model directories are called."""
    layer_windows: str = ""
    """Each layer's attention span, comma-separated: `full` or the sliding window in tokens
    (`window_layers` builds it); which blocks a layer reads depends on it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        kv = normalize_kv_cache_dtype(self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", kv)
        if not self.scale_layout:
            object.__setattr__(self, "scale_layout", scale_layout_for(kv))
        expected = _AUTO_DTYPES if kv == "auto" else (_KV_FORMATS[kv][0],)
        if self.dtype not in expected:
            raise ValueError(
                f"a {kv} KV cache is stored as {' or '.join(expected)}, not {self.dtype}"
            )
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError("model_id must be a non-empty string")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def stored_head_dim(self) -> int:
        """The pool's last dimension: head_dim, plus 4 int8 elements of scale for int8."""
        extra = _KV_FORMATS[self.kv_cache_dtype][1] if self.kv_cache_dtype in _KV_FORMATS else 0
        return self.head_dim + extra

    @property
    def kv_format(self) -> str:
        """The storage format in words, for errors and logs: 'int8 (int8, scales ...)'."""
        return f"{self.kv_cache_dtype} ({self.dtype}, scales: {self.scale_layout})"

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block: `kv_cache.shape[1:]`."""
        return (self.num_kv_heads, self.num_layers, 2, self.block_size, self.stored_head_dim)

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
    def for_pool(
        cls,
        kv_cache: Any,
        model_id: str,
        kv_cache_dtype: str = "auto",
        architecture: str = "",
        layer_windows: str = "",
    ) -> KVCompat:
        """The descriptor of an existing pool tensor holding `kv_cache_dtype` KV (the engine's
        EngineConfig.kv_cache_dtype). PoolError if it is not 6-D or not of that format."""
        shape = tuple(kv_cache.shape)
        if len(shape) != 6 or shape[3] != 2:
            raise PoolError(
                f"KV pool must be [num_blocks, num_kv_heads, num_layers, 2, block_size, "
                f"head_dim], got shape {list(shape)}"
            )
        _, heads, layers, _, block_size, stored = shape
        kv = normalize_kv_cache_dtype(kv_cache_dtype)
        head_dim = stored - (_KV_FORMATS[kv][1] if kv in _KV_FORMATS else 0)
        try:
            return cls(
                model_id,
                normalize_dtype(kv_cache.dtype),
                block_size,
                layers,
                heads,
                head_dim,
                kv_cache_dtype=kv,
                architecture=architecture,
                layer_windows=layer_windows,
            )
        except ValueError as e:
            raise PoolError(
                f"KV pool of shape {list(shape)} and dtype {kv_cache.dtype} is not "
                f"a {kv} KV cache: {e}"
            ) from e

    def check_pool(self, kv_cache: Any, num_heads: int | None = None) -> None:
        """Raise PoolError unless `kv_cache` is a contiguous pool of exactly this layout —
        holding `num_heads` of the KV heads (one rank's of a tensor-parallel worker), or all."""
        shape = tuple(kv_cache.shape)
        if self.layout != BLOCK_MAJOR_LAYOUT:
            raise PoolError(
                f"KV layout {self.layout!r} is not the one this version stores "
                f"({BLOCK_MAJOR_LAYOUT!r})"
            )
        block = list(self.block_shape)
        block[0] = self.num_kv_heads if num_heads is None else num_heads
        if len(shape) != 6 or list(shape[1:]) != block:
            raise PoolError(
                f"KV pool shape {list(shape)} does not match [num_blocks, "
                f"{', '.join(map(str, block))}] of {self.model_id}"
            )
        if normalize_dtype(kv_cache.dtype) != self.dtype:
            raise PoolError(f"KV pool dtype {kv_cache.dtype} != compat dtype {self.dtype}")
        if self.scale_layout != scale_layout_for(self.kv_cache_dtype):
            raise PoolError(
                f"scale layout {self.scale_layout!r} is not the one this version "
                f"stores for {self.kv_cache_dtype} KV "
                f"({scale_layout_for(self.kv_cache_dtype)!r})"
            )
        if not kv_cache.is_contiguous():
            raise PoolError("KV pool must be contiguous (one block = one contiguous region)")
        if shape[0] <= 0:
            raise PoolError("KV pool has no blocks")


def window_layers(windows: Any) -> str:
    """`layer_windows` of per-layer windows (None = full attention): '8,full,8,full'."""
    return ",".join("full" if w is None else str(int(w)) for w in windows)


def check_compatible(local: KVCompat, remote: KVCompat, peer: str = "peer") -> None:
    """Raise IncompatiblePeerError naming every field that differs between the two pools
    (and both KV storage formats when those differ)."""
    if local == remote:
        return
    diffs = [
        f"{f.name}: ours={getattr(local, f.name)!r} theirs={getattr(remote, f.name)!r}"
        for f in fields(KVCompat)
        if getattr(local, f.name) != getattr(remote, f.name)
    ]
    formats = ""
    if local.kv_format != remote.kv_format:
        formats = (
            f"; KV cache formats differ: ours {local.kv_format}, theirs "
            f"{remote.kv_format} — start both workers with the same --kv-cache-dtype"
        )
    raise IncompatiblePeerError(
        f"refusing KV transfer with {peer}: incompatible KV layout ({'; '.join(diffs)}){formats}"
    )
