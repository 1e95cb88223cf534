"""Block id checks (run before anything is posted) and the memory of recently finished ids."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtransfer.errors import BlockRangeError


def unique_block_ids(ids: Sequence[int], num_blocks: int, what: str) -> np.ndarray:
    """`ids` as an int64 array; BlockRangeError unless all are ints in [0, num_blocks), unique."""
    arr = _int_array(ids, what)
    if arr.ndim != 1:
        raise BlockRangeError(f"{what} must be a flat sequence of ints, got shape {arr.shape}")
    _check_range(arr, num_blocks, what)
    if len(np.unique(arr)) != len(arr):
        raise BlockRangeError(f"{what} contains repeated block ids")
    return arr


def block_pairs(
    pairs: Sequence[tuple[int, int]], local_blocks: int, remote_blocks: int
) -> tuple[np.ndarray, np.ndarray]:
    """(local ids, remote ids) of `pairs`; remote ids unique within the batch."""
    arr = _int_array(pairs, "block pairs")
    if arr.size == 0:
        arr = arr.reshape(0, 2)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise BlockRangeError(f"block pairs must be (local, remote) pairs, got shape {arr.shape}")
    local, remote = arr[:, 0].copy(), arr[:, 1].copy()
    _check_range(local, local_blocks, "local block ids")
    _check_range(remote, remote_blocks, "remote block ids")
    if len(np.unique(remote)) != len(remote):
        raise BlockRangeError("a batch writes the same remote block twice")
    return local, remote


def _int_array(ids: object, what: str) -> np.ndarray:
    if _has_bool(ids):  # numpy would quietly turn True into 1
        raise BlockRangeError(f"{what} must be integers, got a bool")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise BlockRangeError(f"{what} are not integers: {e}") from e
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise BlockRangeError(f"{what} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _has_bool(x: object) -> bool:
    if isinstance(x, (list, tuple)):
        return any(_has_bool(e) for e in x)
    return isinstance(x, (bool, np.bool_))


def _check_range(arr: np.ndarray, num_blocks: int, what: str) -> None:
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_blocks):
        bad = arr[(arr < 0) | (arr >= num_blocks)]
        raise BlockRangeError(
            f"{what} out of range [0, {num_blocks}): {bad[:8].tolist()}"
            + (" ..." if len(bad) > 8 else "")
        )


class RecentIds:
    """A bounded set of finished request ids (oldest forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = max(0, capacity)
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
