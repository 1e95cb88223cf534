"""A prefill worker on one emulated host, decode workers on the other (network namespaces
joined by a veth pair), etcd beside the decode workers: gRPC, etcd and the KV (NIXL over UCX
TCP) all cross the veth. The test's client runs in the decode host's namespace too
(`NetnsChild` serving pd_cluster's helpers); the reference engine runs here."""

import random
import time

import grpc
import pytest
from netns_e2e import NetnsEtcd, NetnsWorker
from netns_kv import write_transports
from netns_util import NetnsChild, netem, netem_unavailable, packet_loss, rate_limit, two_hosts
from pd_cluster import NUM_LAYERS, tokens_by_index

from engine import LLM, SamplingParams
from proto import pdserve_pb2 as pb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(hosts, client, prefill, decode, decode with a 1 s KV deadline)."""
    logs = tmp_path_factory.mktemp("netns-workers")
    with two_hosts() as hosts:
        started = []
        etcd = NetnsEtcd(hosts.decode, logs / "etcd")
        try:
            client = NetnsChild(
                hosts.decode, "netns_util:serve_calls", log_path=logs / "client.log"
            )
            started.append(client)
            client.ready()
            assert client.run("cluster.net:wait_for_port", hosts.decode.addr, 2379, 20.0)
            # A tiny prefill token budget: every prompt is chunked into several transfer batches.
            prefill = NetnsWorker(
                hosts.prefill,
                "prefill",
                etcd.endpoint,
                "--max-num-batched-tokens",
                "24",
                log_dir=logs,
            )
            started.append(prefill)
            decode = NetnsWorker(
                hosts.decode, "decode", etcd.endpoint, "--kv-timeout", "20", log_dir=logs
            )
            started.append(decode)
            # In the prefill worker's cluster: it writes only into registered workers.
            hurried = NetnsWorker(
                hosts.decode, "decode", etcd.endpoint, "--kv-timeout", "1", log_dir=logs
            )
            started.append(hurried)
            for w in (prefill, decode, hurried):
                w.wait_ready()
            yield hosts, client, prefill, decode, hurried
        finally:
            for proc in reversed(started):
                proc.stop() if isinstance(proc, NetnsChild) else proc.terminate()
            etcd.stop()


@pytest.fixture(scope="module")
def reference_llm(model_dir):
    return LLM(str(model_dir), num_layers=NUM_LAYERS, kv_cache_memory=32 << 20, dtype="float32")


def _request(rid, tokens, prefill, max_tokens=12):
    req = pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens),
    )
    req.prefill_worker.CopyFrom(pb.WorkerRef(worker_id=prefill.worker_id, address=prefill.address))
    return req


def _prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 150))] for _ in range(n)]


def _kv_metric(client, worker, name, direction):
    return client.run(
        "pd_cluster:metric",
        worker.metrics_address,
        f"pdserve_kv_transfer_{name}_total",
        direction=direction,
    )


def _assert_parity(client, prefill, decode, reference_llm, prompts, tag):
    """Greedy outputs through decode + prefill equal a single engine's; both pools end free."""
    requests = [_request(f"{tag}-{i}", p, prefill) for i, p in enumerate(prompts)]
    results = client.run("netns_e2e:generate_all", decode.address, requests)
    expected = reference_llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    for responses, ref in zip(results, expected):
        assert {r.prefill_mode for r in responses} == {"remote"}
        assert tokens_by_index(responses)[0] == ref.outputs[0].token_ids
        assert responses[-1].finish_reason == ref.outputs[0].finish_reason
    for worker in (prefill, decode):
        client.run("pd_cluster:wait_all_blocks_free", worker.address, 10.0)


def test_disaggregated_greedy_across_hosts_equals_single_engine(cluster, reference_llm):
    hosts, client, prefill, decode, _ = cluster
    prompts = _prompts(6, seed=0)
    blocks0 = _kv_metric(client, decode, "blocks", "receive")
    bytes0 = _kv_metric(client, decode, "bytes", "receive")
    tx0, rx0 = hosts.prefill.link_bytes()[0], hosts.decode.link_bytes()[1]
    _assert_parity(client, prefill, decode, reference_llm, prompts, "parity")
    landed = _kv_metric(client, decode, "blocks", "receive") - blocks0
    assert landed == sum(-(-len(p) // 16) for p in prompts)
    kv_bytes = _kv_metric(client, decode, "bytes", "receive") - bytes0
    assert kv_bytes > 0
    # Every KV byte crossed the veth (with gRPC and etcd beside it), written over TCP.
    assert hosts.prefill.link_bytes()[0] - tx0 >= kv_bytes
    assert hosts.decode.link_bytes()[1] - rx0 >= kv_bytes
    assert write_transports(prefill.log_path.read_text()) == {f"tcp/{hosts.prefill.dev}"}


def test_packet_loss_requests_succeed_and_free_every_block(cluster, reference_llm):
    hosts, client, prefill, decode, _ = cluster
    with packet_loss(hosts, 1) as dropped:
        _assert_parity(client, prefill, decode, reference_llm, _prompts(4, seed=1), "loss")
        assert dropped() > 0


def test_netem_delay_and_loss_requests_succeed_and_free_every_block(cluster, reference_llm):
    hosts, client, prefill, decode, _ = cluster
    reason = netem_unavailable(hosts)
    if reason:
        pytest.skip(reason)
    with netem(hosts, "delay 20ms loss 1%"):
        _assert_parity(client, prefill, decode, reference_llm, _prompts(4, seed=2), "netem")


def test_kv_slowed_past_the_deadline_fails_clearly_and_frees(cluster, reference_llm):
    """A 256 kbit/s link: one block of a 600-token prompt's KV (48 KiB) needs ~1.5 s, longer
    than the decode worker's KV window (1 s) — no notification, not even P's keepalives queued
    behind the data, arrives within it. The request fails with DEADLINE_EXCEEDED, both workers
    free every block, and with the link fast again the same decode worker serves remotely.
    (A link slow but within the window keeps the transfer alive: it follows its progress.)"""
    hosts, client, prefill, _, hurried = cluster
    prompt = [random.Random(6).randrange(100, 40000) for _ in range(600)]
    with rate_limit(hosts, "256kbit"):
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            client.run("pd_cluster:generate", hurried.address, _request("late", prompt, prefill))
        assert time.monotonic() - t0 < 10
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    for worker in (hurried, prefill):
        client.run("pd_cluster:wait_all_blocks_free", worker.address, 15.0)
    _assert_parity(client, prefill, hurried, reference_llm, _prompts(2, seed=3), "recovered")
