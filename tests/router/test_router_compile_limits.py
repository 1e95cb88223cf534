"""Grammar compiles at the router are shared fairly between API keys and bounded
(router/generation/structured.py `Grammars`, engine/structured/fair_slots.py): a benign
constraint of one key waits for at most the one compile another key's pile is running; a
request that gets no compile slot in time is a 503 with Retry-After and an OpenAI body, never a
hang; nested counted repetitions over --max-grammar-repetitions are a 400 naming the field and
the setting, before any compile; the seconds a compile took are charged to its key
(router/http/key_limits.py) and a key over --max-compile-seconds-per-minute-per-key is a 429
while cached constraints and other keys are served; the endpoint picker applies the key's
limits. A real uvicorn server on loopback (lifespan off: no etcd); the compile process is
stood in for by a function the tests hold (what is under test is who compiles when)."""

import asyncio
import threading
from contextlib import asynccontextmanager

import pytest
from keyed_router import ADMIN, KEY_A, KEY_B, keyed_router

from router.call import Delta
from router.config import LimitsConfig, RouterConfig
from router.endpoint_picker.picker import EndpointPicker
from router.http.auth import _digest, resolve_keys
from router.http.errors import APIError
from router.server import RouterServices, load_model_card

PROMPT = {"prompt": "hello there", "max_tokens": 2}


class Answering:
    """Stands in for router.dispatch.Dispatcher.generate: one token, finished."""

    async def generate(self, prompt, sampling, arrival, priority=0, hint=None):
        yield Delta(0, [42], "a", [], "length", 0)


class HeldCompiles:
    """Stands in for `Grammars._compile` (the compile process): records the constraints in the
    order they compile; one whose regex starts with "slow" holds its slot until `gate` opens;
    each reports `seconds` of compile time."""

    def __init__(self, seconds: float = 0.25) -> None:
        self.ran: list[str] = []
        self.gate = threading.Event()
        self.seconds = seconds

    def __call__(self, params, spent=None):
        self.ran.append(params.regex)
        if params.regex.startswith("slow"):
            self.gate.wait(30)
        if spent is not None:
            spent[0] = self.seconds
        return None


@pytest.fixture(scope="module")
def card():
    return load_model_card(RouterConfig(etcd="127.0.0.1:1"))


@asynccontextmanager
async def router(card, **limits):
    compiles = HeldCompiles()
    async with keyed_router(card, Answering(), timeout=30, **limits) as (services, client):
        services.grammars._compile = compiles  # type: ignore[method-assign]
        try:
            yield services, client, compiles
        finally:
            compiles.gate.set()


def post(client, key, body):
    return client.post(
        "/v1/completions", json={**PROMPT, **body}, headers={"Authorization": f"Bearer {key}"}
    )


async def wait_for(predicate, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_a_benign_constraint_waits_for_one_compile_of_another_keys_pile(card):
    async def main():
        async with router(card) as (services, client, compiles):
            slots = services.grammars.slots
            first = asyncio.create_task(
                post(client, KEY_A, {"guided_regex": "slow0(a{1,20}){1,20}"})
            )
            await wait_for(lambda: compiles.ran == ["slow0(a{1,20}){1,20}"])
            pile = [
                asyncio.create_task(
                    post(client, KEY_A, {"guided_regex": f"slow{i}(a{{1,20}}){{1,20}}"})
                )
                for i in (1, 2)
            ]
            await wait_for(lambda: slots.waiting() == 2)
            benign = asyncio.create_task(post(client, KEY_B, {"guided_regex": "[0-9]{3}"}))
            await wait_for(lambda: slots.waiting() == 3)
            compiles.gate.set()
            responses = await asyncio.gather(first, *pile, benign)
            assert [r.status_code for r in responses] == [200] * 4
            assert compiles.ran.index("[0-9]{3}") == 1, compiles.ran  # only the running one before

    asyncio.run(main())


def test_no_compile_slot_in_time_is_a_503_with_retry_after(card):
    async def main():
        async with router(card, grammar_compile_wait_s=0.2, grammar_compile_timeout_s=3) as (
            services,
            client,
            compiles,
        ):
            held = asyncio.create_task(post(client, KEY_A, {"guided_regex": "slow-[a-z]+"}))
            await wait_for(lambda: compiles.ran == ["slow-[a-z]+"])
            busy = await post(client, KEY_B, {"guided_regex": "[0-9]+"})
            assert busy.status_code == 503, busy.text
            assert busy.headers["retry-after"] == "3"  # the longest the running compile may take
            err = busy.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "compile_busy" and "--grammar-compile-wait" in err["message"]
            assert services.grammars.slots.waiting() == 0  # nothing left queued
            compiles.gate.set()
            assert (await held).status_code == 200
            again = await post(client, KEY_B, {"guided_regex": "[0-9]+"})  # busy is not cached
            assert again.status_code == 200 and compiles.ran[-1] == "[0-9]+"

    asyncio.run(main())


def test_nested_counted_repetitions_are_a_400_before_any_compile(card):
    async def main():
        async with router(card) as (_, client, compiles):
            refused = await post(client, KEY_A, {"guided_regex": "(a{1,50}){1,50}"})
            assert refused.status_code == 400
            err = refused.json()["error"]
            assert (err["param"], err["code"]) == ("guided_regex", "grammar_too_complex")
            assert "2500 copies" in err["message"]
            assert "--max-grammar-repetitions" in err["message"]
            schema = {"type": "string", "pattern": "(((ab|a){0,20}){0,20}){0,20}"}
            refused = await post(
                client,
                KEY_A,
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": schema},
                    }
                },
            )
            err = refused.json()["error"]
            assert (refused.status_code, err["param"]) == (400, "response_format")
            assert "8000 copies" in err["message"]
            assert compiles.ran == []

    asyncio.run(main())


def test_compile_seconds_are_charged_to_the_key_and_throttle_it(card):
    async def main():
        async with router(card, max_compile_seconds_per_minute_per_key=0.4) as (
            services,
            client,
            compiles,
        ):
            lim, a = services.key_limits, _digest(KEY_A)
            assert (await post(client, KEY_A, {"guided_regex": "x1"})).status_code == 200
            assert lim.compile_seconds(a) == 0.25
            assert (await post(client, KEY_A, {"guided_regex": "x2"})).status_code == 200
            assert lim.compile_seconds(a) == 0.5  # the bucket is in debt now
            refused = await post(client, KEY_A, {"guided_regex": "x3"})
            assert refused.status_code == 429, refused.text
            err = refused.json()["error"]
            assert err["code"] == "rate_limit_exceeded"
            assert "--max-compile-seconds-per-minute-per-key" in err["message"]
            assert int(refused.headers["retry-after"]) >= 15  # 0.1 s of debt at 0.4 s a minute
            assert compiles.ran == ["x1", "x2"]
            # A cached constraint compiles nothing: served. Another key has its own bucket.
            assert (await post(client, KEY_A, {"guided_regex": "x1"})).status_code == 200
            assert (await post(client, KEY_B, {"guided_regex": "x3"})).status_code == 200
            assert lim.compile_seconds(_digest(KEY_B)) == 0.25
            # Without a key (an admin key here) the seconds count as the keyless tenant's.
            assert (await post(client, ADMIN, {"guided_regex": "x4"})).status_code == 200
            assert lim.compile_seconds(None) == 0.25 and lim.compile_seconds(a) == 0.5
            assert (
                services.metrics.registry.get_sample_value(
                    "pdserve_router_rate_limited_requests_total", {"reason": "compile_seconds"}
                )
                == 1
            )

    asyncio.run(main())


def test_the_endpoint_picker_applies_the_keys_limits(card):
    async def main():
        config = RouterConfig(
            etcd="127.0.0.1:1",
            api_key=(KEY_A, KEY_B),
            limits=LimitsConfig(max_concurrent_requests_per_key=1),
        )
        services = RouterServices(config, card, resolve_keys(config, {}))
        picker = EndpointPicker(services, "127.0.0.1:8000")
        body = b'{"model": "%s", "prompt": "hi"}' % services.card.name.encode()

        def headers(key):
            return {
                ":method": "POST",
                "content-type": "application/json",
                "authorization": f"Bearer {key}",
            }

        lim, a = services.key_limits, _digest(KEY_A)
        held = lim.admit(a)  # one of A's requests is in progress
        with pytest.raises(APIError) as refused:
            await picker.pick("/v1/completions", headers(KEY_A), body)
        assert (refused.value.status, refused.value.code) == (429, "rate_limit_exceeded")
        # B gets through the limits (no worker is registered here: a 503), holding no slot.
        with pytest.raises(APIError) as no_worker:
            await picker.pick("/v1/completions", headers(KEY_B), body)
        assert no_worker.value.status == 503
        assert (lim.in_flight(a), lim.in_flight(_digest(KEY_B))) == (1, 0)
        lim.release(held)

    asyncio.run(main())
