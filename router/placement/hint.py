"""A placement chosen elsewhere — by the endpoint picker (router/endpoint_picker/picker.py) in front
of this router — carried to the router in two request headers, and followed when it still can
be.

Contract: the picker sets `x-pdserve-decode-worker` (a worker id) and
`x-pdserve-prefill-worker` (a worker id, or empty: the decode worker prefills locally). A
router that runs the picker (`--endpoint-picker-port`) follows them on a request's first
attempt: it places the request among those workers only, with the same policy, so the picker's
choice is the one executed unless those workers have gone, are draining, stale or full since;
then it places the request itself, as if no hint had come. A retry or a migration never
follows the hint (the hinted worker is the one that failed). Other routers ignore the headers.

A hint is followed only if the picker made it: the picker seals it (`HintSeal`: an HMAC with
a secret of this router process, over the two worker ids and the time) in
`x-pdserve-placement-seal`, and the router opens the seal before following it. A client that
reaches the router's HTTP port directly, past the gateway, cannot steer its requests to a
worker of its choice (issue 51): an unsealed, forged or stale hint is ignored and counted.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from router.placement.registry import WorkerState

DECODE_HEADER = "x-pdserve-decode-worker"
PREFILL_HEADER = "x-pdserve-prefill-worker"
SEAL_HEADER = "x-pdserve-placement-seal"
SEAL_MAX_AGE_S = 30.0
"""A seal older than this is stale: the gateway forwards a picked request at once."""


@dataclass(frozen=True, slots=True)
class PlacementHint:
    decode: str
    """The decode worker's id."""
    prefill: str | None
    """The prefill worker's id; None: the decode worker prefills locally."""

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> PlacementHint | None:
        """The hint a request carries (None: none, or no decode worker named)."""
        decode = headers.get(DECODE_HEADER, "").strip()
        if not decode:
            return None
        return cls(decode, headers.get(PREFILL_HEADER, "").strip() or None)

    def headers(self) -> dict[str, str]:
        return {DECODE_HEADER: self.decode, PREFILL_HEADER: self.prefill or ""}

    def exclusion(self, workers: Iterable[WorkerState]) -> frozenset[str]:
        """Every worker but the hinted ones (placement's `exclude`): placing with it can only
        choose the hinted decode worker, and the hinted prefill worker or none."""
        keep = {self.decode, self.prefill}
        return frozenset(w.info.worker_id for w in workers if w.info.worker_id not in keep)


@dataclass(frozen=True)
class HintSeal:
    """Seals the picker's hints and opens them for the router (module docstring). One per
    router process: the picker and the router that follows it share the process."""

    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    clock: Callable[[], float] = time.time

    def headers(self, hint: PlacementHint | None) -> dict[str, str]:
        """The request headers that carry `hint` (None: empty ones, so a client's own
        headers never pass the gateway), sealed."""
        if hint is None:
            return {DECODE_HEADER: "", PREFILL_HEADER: "", SEAL_HEADER: ""}
        stamp = str(round(self.clock() * 1000))  # milliseconds
        return {**hint.headers(), SEAL_HEADER: f"{stamp}.{self._mac(hint, stamp)}"}

    def open(self, headers: Mapping[str, str]) -> tuple[PlacementHint | None, bool]:
        """(the hint the headers carry, or None; whether a hint came that is NOT followed
        because its seal is missing, forged or stale)."""
        hint = PlacementHint.from_headers(headers)
        if hint is None:
            return None, False
        stamp, _, mac = headers.get(SEAL_HEADER, "").partition(".")
        try:
            age = self.clock() - int(stamp) / 1000
        except ValueError:
            return None, True
        sealed = hmac.compare_digest(mac, self._mac(hint, stamp))
        if not sealed or not 0 <= age <= SEAL_MAX_AGE_S:
            return None, True
        return hint, False

    def _mac(self, hint: PlacementHint, stamp: str) -> str:
        message = "\n".join((hint.decode, hint.prefill or "", stamp)).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()
