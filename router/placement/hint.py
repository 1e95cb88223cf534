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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from router.placement.registry import WorkerState

DECODE_HEADER = "x-pdserve-decode-worker"
PREFILL_HEADER = "x-pdserve-prefill-worker"


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
