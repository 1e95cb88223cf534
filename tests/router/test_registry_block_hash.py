"""The router refuses a worker whose published block-hash probe disagrees with its own hashing:
not listed, never placed, no KV-index entries, logged once, counted in
pdserve_router_workers_refused{reason="block_hash_mismatch"}; an agreeing or older (no probe)
worker is placed as before."""

import dataclasses
import logging
from types import SimpleNamespace

from cluster.registration import Capacity, WorkerInfo
from engine.kv.block_hash import block_hash_probe
from router.config import PlacementConfig
from router.metrics import RouterMetrics
from router.placement.events import KVSubscriptions
from router.placement.index import KVIndex
from router.placement.placer import Placer, PromptKey
from router.placement.policy import AffinityPolicy
from router.placement.registry import Refusal, WorkerRegistry
from router.server import RouterServices

WRONG = "0123456789abcdef"
IDS = list(range(200))


def info(wid, role="decode", probe=None, version=0):
    return WorkerInfo(
        worker_id=wid,
        role=role,
        grpc_address=f"{wid}:1",
        model_id="m",
        compat_hash="c",
        block_size=16,
        weights_version=version,
        block_hash_probe=block_hash_probe(16, "auto", version) if probe is None else probe,
        capacity=Capacity(total_blocks=1000, free_blocks=1000, prefill_tokens_per_s=1000.0),
    )


def test_a_disagreeing_worker_is_refused_logged_once_and_counted(caplog):
    registry, index = WorkerRegistry(), KVIndex()
    subs = KVSubscriptions(index, channels=None)
    added = []
    registry.add_listener(lambda i: added.append(i.worker_id), subs.on_removed)
    with caplog.at_level(logging.WARNING, logger="router.placement.registry"):
        for t in range(3):  # republished: still refused, logged once
            registry.put(dataclasses.replace(info("bad", probe=WRONG), updated_at=float(t)))
    registry.put(info("good"))
    registry.put(info("old", probe=""))  # published before probes existed
    assert sorted(w.info.worker_id for w in registry.all()) == ["good", "old"]
    assert added == ["good", "old"]  # no KV-event subscription for the refused one
    assert registry.refused["bad"].reason == "block_hash_mismatch"
    warnings = [r.getMessage() for r in caplog.records if "bad" in r.getMessage()]
    assert len(warnings) == 1 and WRONG in warnings[0] and block_hash_probe(16) in warnings[0]

    services = SimpleNamespace(
        registry=registry,
        metrics=RouterMetrics(),
        index=index,
        config=SimpleNamespace(placement=PlacementConfig()),
    )
    RouterServices.update_gauges(services)
    gauge = services.metrics.workers_refused
    assert gauge.labels("block_hash_mismatch")._value.get() == 1
    assert gauge.labels("model")._value.get() == 0


def test_placement_never_picks_the_refused_worker_even_with_the_whole_prompt_cached():
    registry, index = WorkerRegistry(), KVIndex()
    registry.put(info("bad", probe=WRONG))
    registry.put(info("good"))
    key = PromptKey(IDS)
    index.stored("bad", key.hashes(16))  # whatever the index holds for it
    placer = Placer(registry, index, AffinityPolicy(PlacementConfig()))
    for _ in range(5):
        assert placer.place(key, context=len(IDS) + 8).decode.info.worker_id == "good"
    registry.delete("good")
    assert placer.place(key, context=len(IDS) + 8) is None


def test_a_registered_worker_that_starts_disagreeing_is_dropped_and_one_that_agrees_again_returns():
    registry, index = WorkerRegistry(), KVIndex()
    subs = KVSubscriptions(index, channels=None)
    registry.add_listener(lambda i: None, subs.on_removed)
    registry.put(info("w"))
    index.stored("w", PromptKey(IDS).hashes(16)[:4])
    registry.put(dataclasses.replace(info("w", probe=WRONG), updated_at=1.0))
    assert registry.get("w") is None and index.num_blocks("w") == 0
    registry.put(dataclasses.replace(info("w", version=2), updated_at=2.0))  # agrees again
    assert registry.get("w") is not None and "w" not in registry.refused
    registry.replace_all([])  # gone from etcd: forgotten, refused or not
    registry.put(info("x", probe=WRONG))
    registry.replace_all([])
    assert registry.refused == {}


def test_the_routers_own_checks_keep_their_reasons():
    registry = WorkerRegistry(
        refusal=lambda i: (
            Refusal("model", "other model")
            if i.model_id == "o"
            else "plain"
            if i.model_id == "p"
            else None
        )
    )
    registry.put(dataclasses.replace(info("a"), model_id="o"))
    registry.put(dataclasses.replace(info("b"), model_id="p"))
    registry.put(dataclasses.replace(info("c", probe=WRONG), model_id="o"))  # the probe first
    assert {k: r.reason for k, r in registry.refused.items()} == {
        "a": "model",
        "b": "refused",
        "c": "block_hash_mismatch",
    }
