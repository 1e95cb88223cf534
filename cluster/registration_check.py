"""What a registration document may hold, checked before any of it is used.

A registration is written by whoever can write under the cluster's etcd prefix; the router
opens channels (carrying the cluster token) to its address, sends it prompts and sizes its
KV-index share by its capacity, and workers pair with it as a KV peer. So every field is
checked for type, range and length here, and a document that does not fit is refused whole
(`InvalidRegistration`, logged with its key by the caller) — never half-used.

Rules, by field (the JSON `WorkerInfo.to_json` writes):
- names (`worker_id`, LoRA names): 1-255 characters of `A-Z a-z 0-9 . _ : - [ ]`, no `/`;
  the worker id and role also agree with the key the document was found under.
- addresses (`grpc_address`, `metrics_address`): `host:port`, host an IP address (IPv6 in
  brackets or bare) or a DNS name (RFC 1123 characters, at most 253), port 1-65535;
  `metrics_address` may be empty.
- counts (block counts, tokens, versions, lengths): ints (never bools) in [0, 2**53];
  measurements (rates, seconds): finite numbers in [0, 1e12].
- free text (`model_id`, `compat_hash`, `kv_cache_dtype`, `block_hash_probe`, LoRA paths):
  printable, bounded (see `_TEXT`); `kv_metadata` (the kvtransfer metadata's JSON, parsed
  and checked again by kvtransfer when used): printable ASCII, at most `MAX_KV_METADATA`.
- `capacity`: the known measurements as above; fields a newer worker adds are ignored, but
  at most `MAX_UNKNOWN_CAPACITY` of them, each a bounded number.
- `loras` / `resident_loras`: at most `MAX_LORAS` entries.
- `transfer_selftest` (optional, from workers that run the KV transfer self-test):
  {"gbps", "memcpy_gbps", "ratio": measurements, "path": a name}.
- any other top-level field: refused (an older router does not guess what it means).
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any

from cluster.roles import ROLES


class InvalidRegistration(ValueError):
    """A registration document that does not fit the rules above (the message names the
    field)."""


MAX_DOCUMENT_BYTES = 4 << 20
MAX_KV_METADATA = 2 << 20
"""Characters: a NIXL agent's metadata (UCX worker addresses, memory keys) with a
tensor-parallel group's ranks is kilobytes; megabytes leave room for many ranks."""
MAX_COUNT = 1 << 53
MAX_MEASURE = 1e12
MAX_LORAS = 1024
MAX_UNKNOWN_CAPACITY = 32
SELFTEST_PATH_CHARS = 512  # the transfer self-test's path in words (or why it failed)

_PRINTABLE_ASCII = bytes(range(0x20, 0x7F))
_NAME = re.compile(r"[A-Za-z0-9._:\[\]-]{1,255}")
_HOST = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
_TEXT = {  # field -> most characters
    "model_id": 1024,
    "compat_hash": 256,
    "kv_cache_dtype": 32,
    "block_hash_probe": 256,
}

_COUNTS = ("block_size", "max_model_len", "weights_version")
_BOOLS = ("draining", "sleeping")
_CAPACITY_COUNTS = (
    "total_blocks",
    "free_blocks",
    "running",
    "waiting",
    "queued_prefill_tokens",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "kv_offload_total_blocks",
    "kv_offload_used_blocks",
)
_CAPACITY_MEASURES = (
    "prefill_tokens_per_s",
    "decode_step_s",
    "decode_step_tokens",
    "prefill_step_s",
    "prefill_step_tokens",
    "kv_promote_s_per_block",
    "kv_pull_blocks_per_s",
    "kv_pull_overhead_s",
)
_SELFTEST_MEASURES = ("gbps", "memcpy_gbps", "ratio")
KNOWN_FIELDS = frozenset(
    {
        "worker_id",
        "role",
        "grpc_address",
        "metrics_address",
        "kv_metadata",
        "capacity",
        "updated_at",
        "loras",
        "resident_loras",
        "transfer_selftest",
        *_TEXT,
        *_COUNTS,
        *_BOOLS,
    }
)


def check_registration(doc: Any, key: tuple[str, str] | None = None) -> None:
    """Raise InvalidRegistration unless `doc` (parsed JSON) fits every rule of the module
    docstring; `key`: (role, worker id) of the etcd key it was found under, which the
    document must agree with."""
    if not isinstance(doc, dict):
        raise InvalidRegistration(f"a registration is a JSON object, not {type(doc).__name__}")
    unknown = sorted(set(doc) - KNOWN_FIELDS)
    if unknown:
        raise InvalidRegistration(f"unknown fields {_shorten(', '.join(map(str, unknown)))}")
    for required in ("worker_id", "role", "grpc_address", "model_id", "compat_hash"):
        if required not in doc:
            raise InvalidRegistration(f"{required} is missing")
    _name(doc["worker_id"], "worker_id")
    if doc["role"] not in ROLES:
        raise InvalidRegistration(f"unknown worker role {_shorten(repr(doc['role']))}")
    if key is not None and key != (doc["role"], doc["worker_id"]):
        raise InvalidRegistration(
            f"its key names {key[0]}/{key[1]}, the document {doc['role']}/{doc['worker_id']}"
        )
    _address(doc["grpc_address"], "grpc_address")
    if doc.get("metrics_address", ""):
        _address(doc["metrics_address"], "metrics_address")
    for name, most in _TEXT.items():
        if name in doc:
            _text(doc[name], name, most)
    if "block_size" not in doc:
        raise InvalidRegistration("block_size is missing")
    for name in _COUNTS:
        if name in doc:
            _count(doc[name], name)
    if doc["block_size"] < 1:
        raise InvalidRegistration("block_size must be at least 1")
    for name in _BOOLS:
        if name in doc and not isinstance(doc[name], bool):
            raise InvalidRegistration(f"{name} must be true or false")
    if "updated_at" in doc:
        _measure(doc["updated_at"], "updated_at")
    metadata = doc.get("kv_metadata", "")
    if not isinstance(metadata, str) or len(metadata) > MAX_KV_METADATA:
        raise InvalidRegistration(f"kv_metadata must be a string of at most {MAX_KV_METADATA}")
    # The kvtransfer metadata's JSON. bytes.translate deletes in a C loop several times
    # faster than str.isprintable's (tens of kilobytes here: benchmarks/registration_check_bench).
    if not metadata.isascii() or metadata.encode().translate(None, _PRINTABLE_ASCII):
        raise InvalidRegistration("kv_metadata must be printable ASCII")
    _capacity(doc.get("capacity", {}))
    _loras(doc.get("loras", {}), doc.get("resident_loras", []))
    if doc.get("transfer_selftest") is not None:
        _selftest(doc["transfer_selftest"])


def _capacity(cap: Any) -> None:
    if not isinstance(cap, dict):
        raise InvalidRegistration("capacity must be an object")
    for name in _CAPACITY_COUNTS:
        if name in cap:
            _count(cap[name], f"capacity.{name}")
    for name in _CAPACITY_MEASURES:
        if name in cap:
            _measure(cap[name], f"capacity.{name}")
    unknown = set(cap) - set(_CAPACITY_COUNTS) - set(_CAPACITY_MEASURES)
    if len(unknown) > MAX_UNKNOWN_CAPACITY:
        raise InvalidRegistration(f"capacity has {len(unknown)} unknown fields")
    for name in unknown:
        _text(name, "capacity field name", 64)
        _measure(cap[name], f"capacity.{name}")
    if cap.get("free_blocks", 0) > cap.get("total_blocks", 0):
        raise InvalidRegistration("capacity.free_blocks exceeds capacity.total_blocks")
    if cap.get("kv_offload_used_blocks", 0) > cap.get("kv_offload_total_blocks", 0):
        raise InvalidRegistration(
            "capacity.kv_offload_used_blocks exceeds capacity.kv_offload_total_blocks"
        )


def _loras(loras: Any, resident: Any) -> None:
    if not isinstance(loras, dict) or len(loras) > MAX_LORAS:
        raise InvalidRegistration(f"loras must be an object of at most {MAX_LORAS} adapters")
    for name, path in loras.items():
        _name(name, "a LoRA name")
        _text(path, f"the path of LoRA {name}", 4096)
    if not isinstance(resident, list) or len(resident) > MAX_LORAS:
        raise InvalidRegistration(f"resident_loras must be a list of at most {MAX_LORAS} names")
    for name in resident:
        _name(name, "a resident LoRA name")


def _selftest(test: Any) -> None:
    if not isinstance(test, dict) or set(test) - {*_SELFTEST_MEASURES, "path"}:
        raise InvalidRegistration(
            "transfer_selftest must be an object of gbps, memcpy_gbps, ratio and path"
        )
    for name in _SELFTEST_MEASURES:
        _measure(test.get(name), f"transfer_selftest.{name}")
    _text(test.get("path"), "transfer_selftest.path", SELFTEST_PATH_CHARS)


def _count(value: Any, what: str) -> None:
    if type(value) is not int or not 0 <= value <= MAX_COUNT:
        raise InvalidRegistration(f"{what} must be an integer in [0, 2**53], not {_shown(value)}")


def _measure(value: Any, what: str) -> None:
    if type(value) not in (int, float) or not math.isfinite(value) or not 0 <= value <= MAX_MEASURE:
        raise InvalidRegistration(f"{what} must be a number in [0, 1e12], not {_shown(value)}")


def _text(value: Any, what: str, most: int) -> None:
    if not isinstance(value, str) or len(value) > most or not value.isprintable():
        raise InvalidRegistration(f"{what} must be printable text of at most {most} characters")


def _name(value: Any, what: str) -> None:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidRegistration(
            f"{what} must be 1-255 characters of A-Z a-z 0-9 . _ : - [ ], not {_shown(value)}"
        )


def _address(value: Any, what: str) -> None:
    """`host:port` (IPv4, [IPv6] or a DNS name; port 1-65535)."""
    if not isinstance(value, str) or len(value) > 300:
        raise InvalidRegistration(f"{what} must be host:port, not {_shown(value)}")
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535 or not host:
        raise InvalidRegistration(f"{what} must be host:port, not {_shown(value)}")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        ip = None
    if ip is None and (bracketed or not _HOST.fullmatch(host)):
        raise InvalidRegistration(f"{what} must be host:port, not {_shown(value)}")
    if bracketed and ip is not None and ip.version != 6:
        raise InvalidRegistration(f"{what} holds no IPv6 address in [ ]: {_shown(value)}")


def _shown(value: Any) -> str:
    return _shorten(repr(value))


def _shorten(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[:most] + "..."
