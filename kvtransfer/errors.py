"""Errors raised synchronously by the KV transfer API.

Programming and configuration errors (bad ids, bad metadata, incompatible peers) raise at the
call that caused them. Failures of the transfer itself (a peer died, a deadline passed) never
raise from the engine loop: they are reported per request by `poll()`.
"""


class KVTransferError(Exception):
    """Base class of every error raised by `kvtransfer`."""


class MetadataError(KVTransferError, ValueError):
    """Peer metadata is malformed, truncated, of another version or of another backend."""


class IncompatiblePeerError(KVTransferError):
    """The peer's KV layout differs from ours (model, dtype, block size, shape or layout)."""


class UnknownPeerError(KVTransferError, KeyError):
    """A transfer named a peer that was never added (or was removed)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "unknown peer"


class BlockRangeError(KVTransferError, ValueError):
    """A block id is not an integer in [0, num_blocks), or is repeated where it must be unique."""


class DuplicateRequestError(KVTransferError, ValueError):
    """A request id is already in flight, or finished recently (ids are per transfer attempt)."""


class RequestStateError(KVTransferError, ValueError):
    """An operation does not fit the request's state (e.g. a batch after the final one)."""


class PoolError(KVTransferError, ValueError):
    """The KV pool tensor does not match its compatibility descriptor, or is not registered."""
