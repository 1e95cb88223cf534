"""Per-API-key limits through the router's HTTP surface (router/http/key_limits.py, wired in
router/http/middleware.py): a key at its concurrency limit gets a 429 (OpenAI's body,
`rate_limit_exceeded`, Retry-After) while another key and the admin key are served; a stream's
slot is freed when it ends and when its client disconnects; a refused request (429 or 400) holds
no slot and spends no tokens; a request's tokens are reserved and reconciled with what it
generated; the flags need API keys; a request the cluster failed before a token is not charged.
A real uvicorn server on loopback (lifespan off: no etcd) over a stand-in for the dispatcher
whose calls the tests hold open."""

import asyncio
from contextlib import asynccontextmanager

import httpx
import pytest
from keyed_router import ADMIN, KEY_A, KEY_B, keyed_router

from router.call import Delta
from router.config import LimitsConfig, RouterConfig
from router.http.auth import _digest, resolve_keys
from router.http.errors import APIError
from router.server import load_model_card

PROMPT = {"prompt": "hello there", "max_tokens": 10}


class HeldDispatcher:
    """Stands in for router.dispatch.Dispatcher.generate: each call yields one token at once,
    then waits for `release` before its last token; `closed` counts calls that ended (finished
    or cancelled, as a worker call is on a client disconnect)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.closed = 0

    async def generate(self, prompt, sampling, arrival, priority=0, hint=None):
        self.started += 1
        try:
            yield Delta(0, [42], "a", [], None, 0)
            await self.release.wait()
            yield Delta(0, [43], "b", [], "length", 0)
        finally:
            self.closed += 1


class NoCapacity:
    """A dispatcher whose every call finds no worker with room (a 503, as Dispatcher.acquire's)."""

    async def generate(self, prompt, sampling, arrival, priority=0, hint=None):
        raise APIError(503, "no worker has capacity for this request", code="overloaded")
        yield


@pytest.fixture(scope="module")
def card():
    return load_model_card(RouterConfig(etcd="127.0.0.1:1"))


@asynccontextmanager
async def router(card, **limits):
    held = HeldDispatcher()
    async with keyed_router(card, held, timeout=10, **limits) as (services, client):
        try:
            yield services, client
        finally:
            held.release.set()


def post(client, key, path="/v1/completions", body=PROMPT, **kw):
    return client.post(path, json=body, headers={"Authorization": f"Bearer {key}"}, **kw)


@asynccontextmanager
async def stream(client, key, body=PROMPT):
    """A streamed completion whose first chunk has arrived (its slot is held)."""
    request = client.build_request(
        "POST",
        "/v1/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
    )
    response = await client.send(request, stream=True)
    assert response.status_code == 200, await response.aread()
    lines = response.aiter_lines()
    assert (await anext(lines)).startswith("data: ")
    try:
        yield response, lines
    finally:
        await response.aclose()


def rate_limited(response: httpx.Response) -> dict:
    assert response.status_code == 429, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert int(response.headers["retry-after"]) >= 1
    return err


async def wait_for(predicate, timeout=5.0):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def refusals(services, reason) -> float:
    return services.metrics.registry.get_sample_value(
        "pdserve_router_rate_limited_requests_total", {"reason": reason}
    )


def test_a_key_at_its_limit_gets_429_while_another_key_is_served(card):
    async def main():
        async with router(card, max_concurrent_requests_per_key=1) as (services, client):
            lim, a = services.key_limits, _digest(KEY_A)
            async with stream(client, KEY_A):
                assert lim.in_flight(a) == 1
                err = rate_limited(await post(client, KEY_A))
                assert "--max-concurrent-requests-per-key" in err["message"]
                assert (await post(client, KEY_A)).headers["retry-after"] == "1"
                rate_limited(await post(client, KEY_A, "/v1/embeddings", {"input": "x"}))
                rate_limited(
                    await post(
                        client,
                        KEY_A,
                        "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]},
                    )
                )
                # /tokenize and /detokenize spend the router's CPU on the key's text: limited.
                rate_limited(await post(client, KEY_A, "/tokenize", {"prompt": "x"}))
                rate_limited(await post(client, KEY_A, "/detokenize", {"tokens": [42]}))
                # Key B and the admin key are served meanwhile.
                assert (await post(client, KEY_B, "/tokenize", {"prompt": "x"})).status_code == 200
                async with stream(client, KEY_B), stream(client, ADMIN):
                    assert lim.in_flight(_digest(KEY_B)) == 1
                assert lim.in_flight(a) == 1  # the refusals took no slot
            assert refusals(services, "concurrency") == 6
            assert refusals(services, "tokens") == 0
            assert (
                services.metrics.registry.get_sample_value(
                    "pdserve_router_requests_total",
                    {"endpoint": "/v1/completions", "status": "429"},
                )
                == 2
            )
            await wait_for(lambda: lim.in_flight(a) == 0)

    asyncio.run(main())


def test_a_stream_frees_its_slot_when_it_ends(card):
    async def main():
        async with router(card, max_concurrent_requests_per_key=1) as (services, client):
            lim, a = services.key_limits, _digest(KEY_A)
            async with stream(client, KEY_A) as (_, lines):
                services.dispatcher.release.set()
                rest = [line async for line in lines if line]
                assert rest[-1] == "data: [DONE]"
            await wait_for(lambda: lim.in_flight(a) == 0)
            services.dispatcher.release.clear()
            async with stream(client, KEY_A):  # the slot is free again
                pass

    asyncio.run(main())


def test_a_client_disconnect_frees_the_slot(card):
    async def main():
        async with router(card, max_concurrent_requests_per_key=1) as (services, client):
            lim, a, held = services.key_limits, _digest(KEY_A), services.dispatcher
            for _ in range(3):
                async with stream(client, KEY_A):
                    assert lim.in_flight(a) == 1
                # The client left mid-stream: the worker call is cancelled, the slot freed.
                await wait_for(lambda: lim.in_flight(a) == 0 and held.closed == held.started)
            # ... also a non-streamed request whose client left before its answer.
            task = asyncio.create_task(post(client, KEY_A))
            await wait_for(lambda: held.started == 4)
            task.cancel()
            await wait_for(lambda: lim.in_flight(a) == 0 and held.closed == 4)
            assert held.started == 4 and not held.release.is_set()

    asyncio.run(main())


def test_a_refused_request_holds_nothing(card):
    async def main():
        async with router(
            card, max_concurrent_requests_per_key=2, max_tokens_per_minute_per_key=600
        ) as (services, client):
            lim, a = services.key_limits, _digest(KEY_A)
            lim.clock = lambda: 0.0  # no refill during the test
            async with stream(client, KEY_A, {"prompt": "hi", "max_tokens": 500}):
                left = lim.available(a)
                assert 0 < left < 100
                err = rate_limited(
                    await post(client, KEY_A, body={"prompt": "hi", "max_tokens": 200})
                )
                assert "--max-tokens-per-minute-per-key" in err["message"]
                # A 400 (refused before its tokens are counted) holds nothing either.
                bad = await post(client, KEY_A, body={"prompt": "hi", "max_tokens": -1})
                assert bad.status_code == 400
                assert lim.in_flight(a) == 1 and lim.available(a) == left
                assert services.dispatcher.started == 1
            assert refusals(services, "tokens") == 1

    asyncio.run(main())


def test_tokens_are_reserved_then_reconciled_with_what_was_generated(card):
    async def main():
        async with router(card, max_tokens_per_minute_per_key=1200) as (services, client):
            lim, a = services.key_limits, _digest(KEY_A)
            lim.clock = lambda: 0.0
            prompt = len(card.tokenizer.encode(PROMPT["prompt"]))
            async with stream(client, KEY_A, {**PROMPT, "n": 2}):
                assert lim.available(a) == 1200 - prompt - 2 * 10  # max_tokens x n reserved
                services.dispatcher.release.set()
            await wait_for(lambda: lim.in_flight(a) == 0)
            assert lim.available(a) == 1200 - prompt - 2  # what it used: 2 tokens generated
            # Over a minute's budget: it needs a full bucket (A's lacks prompt + 2 tokens, at
            # 20 tokens/s), then overdraws it; B's is full: it runs.
            big = {**PROMPT, "max_tokens": 2000}
            response = await post(client, KEY_A, body=big)
            rate_limited(response)
            assert response.headers["retry-after"] == str(-(-(prompt + 2) // 20))
            assert (await post(client, KEY_B, body=big)).status_code == 200
            assert lim.available(_digest(KEY_B)) == 1200 - prompt - 2
            # A request the cluster could not serve (503, no token) is not charged.
            services.dispatcher = NoCapacity()
            assert (await post(client, KEY_B)).status_code == 503
            assert lim.available(_digest(KEY_B)) == 1200 - prompt - 2

    asyncio.run(main())


def test_the_flags_need_api_keys():
    for flag in ("max_concurrent_requests_per_key", "max_tokens_per_minute_per_key"):
        config = RouterConfig(etcd="h:1", limits=LimitsConfig(**{flag: 1}))
        with pytest.raises(ValueError, match="needs API keys"):
            resolve_keys(config, {})
        assert resolve_keys(config, {"PDSERVE_API_KEY": "k1-0123456789abcdef"}).api
    with pytest.raises(ValueError, match="must be >= 0"):
        LimitsConfig(max_tokens_per_minute_per_key=-1)
