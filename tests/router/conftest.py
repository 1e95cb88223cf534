"""Fixtures for router tests: one etcd and one background event loop per module; each test
uses its own cluster name, so registrations never mix."""
import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # router_fakes, router_harness

from cluster.etcd_server import EtcdServer  # noqa: E402
from router_harness import LoopThread  # noqa: E402

_clusters = itertools.count()


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def bg():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture
def cluster_name(request):
    return f"t{next(_clusters)}-{request.node.name[:40]}".replace("[", "-").replace("]", "")
