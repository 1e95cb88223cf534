"""Fixtures of the kvtransfer tests: a fake fabric with a prefill (P) and a decode (D) backend."""

import pytest
from kv_fake_util import make

from kvtransfer import FakeFabric


@pytest.fixture
def fabric():
    return FakeFabric()


@pytest.fixture
def pd(fabric):
    """P (32 blocks) with D (48 blocks) added as its peer: (p, p_pool, d, d_pool)."""
    p, ppool = make(fabric, "P", 32, seed=1)
    d, dpool = make(fabric, "D", 48, seed=2)
    assert p.add_peer(d.metadata().to_bytes()) == "D"
    return p, ppool, d, dpool
