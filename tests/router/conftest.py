"""Fixtures for router tests: one etcd and one background event loop per module; each test
uses its own cluster name, so registrations never mix. `e2e`: one real cluster for the whole
session (openai_cluster.py), shared by the OpenAI-client tests."""

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # router_fakes, router_harness

from openai_cluster import KEY, NUM_LAYERS, start_cluster, workers_unavailable  # noqa: E402
from router_harness import LoopThread  # noqa: E402

from cluster.etcd_server import EtcdServer  # noqa: E402

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


@pytest.fixture(scope="session")
def e2e(tmp_path_factory):
    reason = workers_unavailable()
    if reason:
        pytest.skip(reason)
    with start_cluster(tmp_path_factory.mktemp("router-e2e")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def client(e2e):
    import openai

    return openai.OpenAI(base_url=e2e.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def reference(model_dir):
    """A single in-process engine computing exactly what the cluster's workers compute."""
    from engine import LLM

    return LLM(str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=64 << 20, dtype="float32")
