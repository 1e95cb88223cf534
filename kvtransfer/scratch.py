"""Buffers of the KV transfer self-test (selftest.py): scratch pools shaped like a worker's,
their bytes, and the memcpy the transfer is compared with."""

from __future__ import annotations

import math
import time
from typing import Any


def same_bytes(a: Any, b: Any) -> bool:
    """Two tensors hold the same bytes (NaN garbage in a fresh pool equals itself here)."""
    import torch

    return bool(torch.equal(as_bytes(a), as_bytes(b)))


def block_bytes(pool: Any) -> int:
    """Bytes of one block of a block-major pool tensor."""
    return int(pool.stride(0) * pool.element_size())


def as_bytes(t: Any) -> Any:
    """A contiguous tensor's bytes, as a uint8 view of the same memory."""
    import torch

    return t.contiguous().view(torch.uint8)


def scratch_like(pool: Any, num_blocks: int) -> Any:
    """Zeroed blocks of `pool`'s geometry and dtype on its device. On CPU the buffer is
    2 MiB-aligned and asks for transparent huge pages before it is touched, as the engine's
    pool does (engine/kv/kv_pool.py): CMA into 4 KiB pages runs at half the speed."""
    import torch

    shape = (num_blocks, *pool.shape[1:])
    if pool.device.type != "cpu":
        return torch.zeros(shape, dtype=pool.dtype, device=pool.device)
    huge = 2 << 20
    nbytes = num_blocks * block_bytes(pool)
    buf = torch.empty(nbytes + huge, dtype=torch.uint8)
    offset = -buf.data_ptr() % huge
    region = buf[offset : offset + nbytes]
    _advise_huge_pages(region.data_ptr(), nbytes)
    return region.view(pool.dtype).view(shape).zero_()


def _advise_huge_pages(addr: int, nbytes: int) -> None:
    import ctypes
    import sys

    huge, madv_hugepage = 2 << 20, 14
    end = (addr + nbytes) & ~(huge - 1)
    if sys.platform.startswith("linux") and end > addr:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(end - addr), madv_hugepage)


def memcpy_seconds(src: Any, rounds: int) -> float:
    """The best of `rounds` one-thread copies of `src` into a scratch buffer like the
    self-test's (after a warm-up copy)."""
    import numpy as np
    import torch

    dst = scratch_like(src, src.shape[0])
    cuda = src.device.type == "cuda"
    if not cuda:
        a, b = as_bytes(dst).numpy(), as_bytes(src).numpy()
    best = math.inf
    for i in range(1 + rounds):
        t0 = time.perf_counter()
        if cuda:
            dst.copy_(src)
            torch.cuda.synchronize(src.device)
        else:
            np.copyto(a, b)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best
