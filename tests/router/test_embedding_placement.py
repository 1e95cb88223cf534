"""Prefill-only placement for embeddings (Policy.place_prefill), on hand-built candidates:
prefix affinity against queued prefill work, no decode worker ever, no queue-limit fallback."""

from test_policy import affinity, pre


def test_prefix_affinity_and_prefill_load():
    p = affinity()
    assert p.place_prefill(1024, [pre("a"), pre("b", cached=768)]).worker_id == "b"
    # Queued work on the caching worker outweighs its hit.
    assert p.place_prefill(1024, [pre("a"), pre("b", cached=768, queued=4000)]).worker_id == "a"


def test_only_usable_prefill_workers_over_the_queue_limit_too():
    p = affinity(prefill_queue_limit=100)
    assert p.place_prefill(64, [pre("a", draining=True), pre("b", stale=True)]) is None
    assert p.place_prefill(64, []) is None
    # Every worker over the limit: there is no local fallback, the least loaded one runs it.
    assert p.place_prefill(64, [pre("a", queued=500), pre("b", queued=300)]).worker_id == "b"
