"""Chained block hashes: the identity of a full KV block's contents, stable across processes.

hash(block i) = sha256(hash(block i-1) || extras || token ids of block i as little-endian int64)

Extras (cache_salt for tenant isolation, LoRA id, a quantized KV dtype) enter every block's hash, so
equal tokens under different salts never share blocks. The router imports `compute_block_hashes` to
predict which workers hold a prompt's prefix: the same bytes in, the same hashes out, in any
process. `block_hash_probe` is a short fingerprint of this hashing that workers publish, so that a
process hashing the same tokens differently is found at start (cluster/block_hash_agreement.py).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Sequence

import numpy as np

BlockHash = bytes  # 32-byte sha256 digest

_ROOT = b"pdserve-block-hash-v1"


def hash_extras(
    cache_salt: str | None = None,
    lora_id: int | None = None,
    kv_cache_dtype: str = "auto",
    weights_version: int = 0,
) -> bytes:
    """Bytes mixed into every block hash of a request (empty when there are no extras). A
    quantized KV cache (`kv_cache_dtype` other than auto) is an extra: its blocks hold other
    bytes than the model dtype's for the same tokens; so is the weights version (bumped by
    every weight update): KV computed by older weights is never reused."""
    kv = b"" if kv_cache_dtype == "auto" else b"kv:" + kv_cache_dtype.encode()
    version = b"" if weights_version == 0 else b"w:" + str(weights_version).encode()
    if cache_salt is None and lora_id is None and not kv and not version:
        return b""
    salt = (cache_salt or "").encode("utf-8")
    return struct.pack("<qI", -1 if lora_id is None else lora_id, len(salt)) + salt + kv + version


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extras: bytes = b""
) -> BlockHash:
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(struct.pack("<I", len(extras)))
    h.update(extras)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    lora_id: int | None = None,
    kv_cache_dtype: str = "auto",
    weights_version: int = 0,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block gets none)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(
        hashes,
        token_ids,
        block_size,
        hash_extras(cache_salt, lora_id, kv_cache_dtype, weights_version),
    )
    return hashes


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extras: bytes
) -> None:
    """Append the hashes of full blocks of `token_ids` that `hashes` does not cover yet."""
    parent = hashes[-1] if hashes else None
    for begin in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size], extras)
        hashes.append(parent)


_PROBE_SALT, _PROBE_LORA_ID = "pdserve-probe", 7


@functools.lru_cache(maxsize=64)
def block_hash_probe(
    block_size: int, kv_cache_dtype: str = "auto", weights_version: int = 0
) -> str:
    """A fingerprint (16 hex digits) of how this code hashes blocks under these settings: the
    last chained hash of a fixed two-block token sequence, without extras and with a salt and
    a LoRA id, digested together. Two processes that publish different probes for the same
    (block size, KV cache dtype, weights version) would never find each other's blocks."""
    tokens = [(i * 7919 + 13) % 30011 for i in range(2 * block_size)]
    plain = compute_block_hashes(tokens, block_size, None, None, kv_cache_dtype, weights_version)
    salted = compute_block_hashes(
        tokens, block_size, _PROBE_SALT, _PROBE_LORA_ID, kv_cache_dtype, weights_version
    )
    return hashlib.sha256(plain[-1] + salted[-1]).hexdigest()[:16]
