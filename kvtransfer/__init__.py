"""Moving KV blocks between workers: a NIXL backend and an in-process fake.

See `kvtransfer.base` for the interface and its contract, and docs/kvtransfer.md.
Importing this package does not import torch or NIXL; the backends do when constructed.
"""

from kvtransfer.base import (
    KVReceiver,
    KVSender,
    KVTransferBackend,
    KVTransferConfig,
    TransferResult,
    TransferStatus,
)
from kvtransfer.compat import BLOCK_MAJOR_LAYOUT, KVCompat, check_compatible
from kvtransfer.errors import (
    BlockRangeError,
    DuplicateRequestError,
    IncompatiblePeerError,
    KVTransferError,
    MetadataError,
    PoolError,
    RequestStateError,
    UnknownPeerError,
)
from kvtransfer.metadata import PeerMetadata
from kvtransfer.metrics import Histogram, PeerMetrics, TransferMetrics
from kvtransfer.polling import Backoff, wait_for

__all__ = [
    "BLOCK_MAJOR_LAYOUT",
    "Backoff",
    "BlockRangeError",
    "DuplicateRequestError",
    "FakeFabric",
    "FakeTransferBackend",
    "Histogram",
    "IncompatiblePeerError",
    "KVCompat",
    "KVReceiver",
    "KVSender",
    "KVTransferBackend",
    "KVTransferConfig",
    "KVTransferError",
    "MetadataError",
    "NixlTransferBackend",
    "PeerMetadata",
    "PeerMetrics",
    "PoolError",
    "RequestStateError",
    "SelftestResult",
    "TransferMetrics",
    "TransferResult",
    "TransferStatus",
    "UnknownPeerError",
    "check_compatible",
    "run_selftest",
    "wait_for",
]


def __getattr__(name: str) -> object:
    # The backends pull in numpy/torch/NIXL; load them only when asked for.
    if name == "NixlTransferBackend":
        from kvtransfer.nixl_backend import NixlTransferBackend

        return NixlTransferBackend
    if name in ("FakeTransferBackend", "FakeFabric"):
        from kvtransfer import fake

        return getattr(fake, name)
    if name in ("SelftestResult", "run_selftest"):  # the start-up self-test (selftest.py)
        from kvtransfer import selftest

        return getattr(selftest, name)
    raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
