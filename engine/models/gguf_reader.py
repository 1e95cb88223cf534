"""A GGUF file's metadata and tensors, read in one pass over the header.

gguf-py's `GGUFReader` builds a numpy view per array item: Gemma's 262,144-token vocabulary
takes it ~30 s. Here the header is parsed with `struct` (well under a second) and the tensor
data stays a memory map, dequantized by gguf-py (`gguf.dequantize`, the reference).
Little-endian GGUF v2/v3 only (what llama.cpp writes); anything else is a ModelFileError.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.models.errors import ModelFileError

_MAGIC = b"GGUF"
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]
    """GGUF order (innermost first); HF's is the reverse."""
    ggml_type: int
    data: np.ndarray
    """The raw bytes, (rows, bytes per row) over a memory map of the file."""


@dataclass(frozen=True)
class GgufFile:
    fields: dict[str, Any]
    tensors: list[GgufTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _SCALARS and item_kind != 7:  # numbers: one numpy read
                dtype = np.dtype(_SCALARS[item_kind])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise ValueError("array runs past the end of the file")
                items = np.frombuffer(self.buf[self.pos : end], dtype=dtype).tolist()
                self.pos = end
                return items
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALARS[kind])


def read_gguf(path: Path) -> GgufFile:
    """The metadata and tensors of the GGUF file at `path`; ModelFileError if it is not one
    (or is truncated)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if not path.is_file():
        raise ModelFileError(f"GGUF file not found: {path}")
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    try:
        cur = _Cursor(mapped.data)  # a memoryview of the mapped bytes
        if bytes(mapped[:4]) != _MAGIC:
            raise ValueError("no GGUF magic number")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian or unknown)")
        n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
        fields = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        alignment = int(fields.get("general.alignment", 32))
        start = -(-cur.pos // alignment) * alignment
        tensors = []
        for name, dims, kind, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            row_bytes = dims[0] // block * block_bytes
            rows = int(np.prod(dims[1:], dtype=np.int64))
            begin = start + offset
            if begin + rows * row_bytes > len(mapped):
                raise ValueError(f"tensor {name} runs past the end of the file")
            data = mapped[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
            tensors.append(GgufTensor(name, dims, kind, data))
    except (ValueError, KeyError, struct.error, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file: {exc}") from exc
    return GgufFile(fields, tensors)


def dequantize(tensor: GgufTensor) -> np.ndarray:
    """`tensor` as fp32 in HF's (row-major, reversed GGUF) shape."""
    import gguf

    values = gguf.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.ggml_type))
    # a copy: an F32 tensor would otherwise be a read-only view of the memory map
    return np.array(values, dtype=np.float32).reshape(tuple(reversed(tensor.shape)))
