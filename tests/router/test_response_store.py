"""The /v1/responses store (router/endpoints/responses/store.py, `--enable-response-store`):
`previous_response_id` needs it and names a response it holds; it is an LRU bounded in entries
and bytes, per tenant (API key), where past a bound the tenant holding the most loses its least
recently used response. The rest of /v1/responses: test_responses_api.py."""

import json

import pytest

from router.endpoints.responses.serving import _history
from router.endpoints.responses.store import ResponseStore
from router.http.errors import APIError


def test_previous_response_id_needs_the_store():
    with pytest.raises(APIError) as caught:
        _history(None, None, "resp_1")
    assert caught.value.status == 400 and "--enable-response-store" in caught.value.message
    assert caught.value.param == "previous_response_id"
    with pytest.raises(APIError) as caught:
        _history(ResponseStore(4, 1 << 20), None, "resp_1")
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"
    assert _history(None, None, None) == []


def turn(text):
    return [{"role": "user", "content": text}]


def test_store_is_a_bounded_lru_per_tenant():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    store.put(None, "a", turn("1"))
    store.put(None, "b", turn("2"))
    assert store.get(None, "a") == turn("1")  # a is now the most recent
    store.put(None, "c", turn("3"))
    assert store.get(None, "b") is None and len(store) == 2
    assert store.get(None, "a") == turn("1") and store.get(None, "c") == turn("3")
    assert store.get(b"tenant", "a") is None  # another key's responses are unknown
    store.put(b"tenant", "a", turn("4"))
    assert store.get(b"tenant", "a") == turn("4") and store.get(None, "a") is None


def test_store_bounds_the_bytes():
    size = len(json.dumps(turn("x" * 100), separators=(",", ":")))
    store = ResponseStore(max_entries=100, max_bytes=2 * size + 1)
    for key in "abc":
        store.put(None, key, turn("x" * 100))
    assert store.get(None, "a") is None and len(store) == 2 and store.bytes == 2 * size
    store.put(None, "huge", turn("x" * 1000))  # larger than the whole store: not kept
    assert store.get(None, "huge") is None and len(store) == 2


def test_one_tenant_storing_in_a_loop_evicts_only_its_own_responses():
    """Issue 51: a fair share. Past a bound, the tenant holding the most loses its least
    recently used entry — a key storing responses in a loop never evicts another key's."""
    store = ResponseStore(max_entries=6, max_bytes=1 << 20)
    for tenant in (b"alice", b"bob"):
        store.put(tenant, "kept", turn(tenant.decode()))
    for i in range(100):
        store.put(b"mallory", f"r{i}", turn(str(i)))
    assert store.get(b"alice", "kept") == turn("alice")
    assert store.get(b"bob", "kept") == turn("bob")
    others = store.held(b"alice")[1] + store.held(b"bob")[1]
    assert store.held(b"mallory") == (4, store.bytes - others)
    assert store.get(b"mallory", "r99") == turn("99") and store.get(b"mallory", "r0") is None
    size = len(json.dumps(turn("x" * 100), separators=(",", ":")))
    by_bytes = ResponseStore(max_entries=100, max_bytes=4 * size)
    by_bytes.put(b"alice", "kept", turn("x" * 100))
    for i in range(20):
        by_bytes.put(b"mallory", f"r{i}", turn("x" * 100))
    assert by_bytes.get(b"alice", "kept") == turn("x" * 100)
    assert by_bytes.held(b"mallory") == (3, 3 * size) and by_bytes.bytes == 4 * size
