"""benchmarks/multi_turn.py without a cluster: conversations carry the model's answers into the
next turn, statistics count turns >= 2 only, unknown flags are caught before a cluster starts,
and one turn's SSE stream is read into TTFT / prompt / cached tokens."""

import asyncio

import httpx
from bench_cluster import unknown_flags
from multi_turn import (
    Conversation,
    TurnResult,
    build_conversations,
    chat_turn,
    percentile,
    ratio,
    summarize,
)


def test_conversations_are_seeded_distinct_and_grow_with_the_answers():
    a = build_conversations(3, 4, (5, 9), seed=1)
    assert [c.user_messages for c in a] == [
        c.user_messages for c in build_conversations(3, 4, (5, 9), 1)
    ]
    assert all(len(c.user_messages) == 4 for c in a)
    assert all(5 <= len(m.split(":", 1)[1].split()) <= 9 for c in a for m in c.user_messages)
    assert a[0].user_messages[0].startswith("Conversation 0, message 1:")
    c = a[1]
    assert c.messages() == [{"role": "user", "content": c.user_messages[0]}]
    c.answers.append("first answer")
    c.answers.append("second answer")
    assert c.messages() == [
        {"role": "user", "content": c.user_messages[0]},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": c.user_messages[1]},
        {"role": "assistant", "content": "second answer"},
        {"role": "user", "content": c.user_messages[2]},
    ]


def test_statistics_count_the_later_turns_only():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert abs(percentile(list(map(float, range(101))), 99) - 99.0) < 1e-9
    results = [
        TurnResult(0, 1, ttft_s=9.0, prompt_tokens=100, cached_tokens=0),  # turn 1: not counted
        TurnResult(0, 2, ttft_s=0.1, prompt_tokens=200, cached_tokens=150),
        TurnResult(1, 2, ttft_s=0.3, prompt_tokens=200, cached_tokens=50),
        TurnResult(1, 3, error="HTTP 500"),
    ]
    s = summarize(results)
    assert (s.turns, s.errors, s.prompt_tokens) == (2, 1, 400)
    assert abs(s.ttft_p50_ms - 200.0) < 1e-9 and s.hit_rate == 0.5
    assert summarize([]).hit_rate is None
    assert ratio(50.0, 100.0) == 0.5 and ratio(1.0, None) is None and ratio(None, 2.0) is None


def test_unknown_flags_are_named_per_program():
    up, router, worker = {"--model", "--kv-cache-memory"}, {"--policy"}, {"--kv-offloading-size"}
    args = [
        "--model",
        "/m",
        "--kv-cache-memory=1GiB",
        "--router-arg=--policy=round_robin",
        "--worker-arg=--kv-offloading-size=1GiB",
    ]
    assert unknown_flags(args, up, router, worker) == []
    assert unknown_flags(
        [*args, "--router-arg=--no-kv-pull", "--bogus=1", "--decode-arg=--kv-pull"],
        up,
        router,
        worker,
    ) == ["--router-arg=--no-kv-pull", "--bogus=1", "--decode-arg=--kv-pull"]


def test_a_turn_reads_ttft_usage_and_keeps_the_answer():
    chunks = [
        'data: {"choices":[{"delta":{"role":"assistant"}}]}',
        'data: {"choices":[{"delta":{"content":"Hel"}}]}',
        'data: {"choices":[{"delta":{"content":"lo"}}]}',
        'data: {"choices":[],"usage":{"prompt_tokens":120,"completion_tokens":2,'
        '"prompt_tokens_details":{"cached_tokens":96}}}',
        "data: [DONE]",
    ]
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, text="\n\n".join(chunks) + "\n\n")

    async def main():
        conv = Conversation(0, ("hi", "more"))
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            r = await chat_turn(http, "http://x", "m", conv, 8)
            assert (r.turn, r.prompt_tokens, r.cached_tokens, r.output_tokens) == (1, 120, 96, 2)
            assert r.error is None and r.ttft_s is not None and conv.answers == ["Hello"]
            r2 = await chat_turn(http, "http://x", "m", conv, 8)
            assert r2.turn == 2 and conv.answers == ["Hello", "Hello"]
        body = seen[1].read()
        assert b'"assistant","content":"Hello"' in body.replace(b" ", b"")

    asyncio.run(main())
    broken = httpx.MockTransport(lambda req: httpx.Response(200, text=chunks[1] + "\n\n"))

    async def cut():
        conv = Conversation(0, ("hi",))
        async with httpx.AsyncClient(transport=broken) as http:
            r = await chat_turn(http, "http://x", "m", conv, 8)
        assert r.error == "stream ended without [DONE]" and conv.answers == []

    asyncio.run(cut())
