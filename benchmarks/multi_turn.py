"""Multi-turn chat against a `pdserve up --prefill 1 --decode 2` cluster (`--prefill`,
`--decode`): the cluster KV fabric (docs/kv_pull.md) with it off and on, under the router's default
placement and round-robin.

  python benchmarks/multi_turn.py [--conversations 8] [--turns 4] [--max-tokens 32]
      [--first-words 1000,1500] [--user-words 40,120]
      [--concurrency 4] [--policies affinity,round_robin] [--configs off,on]
      [--off-args "..."] [--on-args "..."] [--base-args "..."] [--json OUT]
  (the full size: --conversations 32 --turns 6)

Each conversation is a chat: turn t sends every earlier user message and the model's actual
answer to it, then a new user message (random common words: `--first-words` of them in the
first, a long opening context, `--user-words` in the later, short ones), over
/v1/chat/completions, streaming. Turns of one conversation are sequential; `--concurrency`
conversations run at once. So turn t >= 2 repeats a prefix the cluster has computed before —
on some worker, in its pool or (fabric on) its second tier — and histories grow to 1-3k
tokens. Reported per configuration x placement: TTFT p50/p99 of turns >= 2, their prefix-cache
hit rate (usage.prompt_tokens_details.cached_tokens / prompt_tokens: the router is started
with --enable-prompt-tokens-details), the workers' own prefix-cache counters and second-tier
hits (their /metrics, all turns), and the on/off ratios of the same run.

Configurations are extra `pdserve up` arguments (`--router-arg=...` for the router's,
`--worker-arg=...` for the workers'), each a string split like a shell: "off" = no tier (and
the router's `--no-kv-pull` where the router has it), "on" = `--kv-offloading-size` on the
workers (and `--kv-pull`). Every flag is checked against the `--help` of `pdserve up`, `router`
and `decode` before anything starts: an unknown one fails the run, naming it. The cluster is
started fresh for every configuration x placement (127.0.0.1, free ports, its own
PDSERVE_CACHE) and stopped by its PID (SIGTERM, then SIGKILL of its process group).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench_cluster import Cluster, known_flags, unknown_flags
from cpu_info import cpu_isa

from pdserve.bench.client import parse_sse_line
from pdserve.bench.workload import _WORDS

BASE_ARGS = "--kv-cache-memory=128MiB"
"""The pool of each worker: ~5.8k tokens of SmolLM2 in bf16, enough for the prompts in flight
but not for every conversation's history, so older prefixes are evicted (and, fabric on,
demoted to the tier)."""
TIER = "--kv-offloading-size=1GiB"


# ---- conversations -------------------------------------------------------------------------
@dataclass
class Conversation:
    index: int
    user_messages: tuple[str, ...]
    """One per turn, drawn up front (seeded)."""
    answers: list[str] = field(default_factory=list)
    """The model's answers so far; the next turn is len(answers)."""

    def messages(self) -> list[dict[str, str]]:
        """The next turn's chat: every earlier user message and answer, then the new message."""
        chat: list[dict[str, str]] = []
        for user, answer in zip(self.user_messages, self.answers):
            chat += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        return [*chat, {"role": "user", "content": self.user_messages[len(self.answers)]}]


def build_conversations(
    n: int,
    turns: int,
    words: tuple[int, int],
    seed: int = 0,
    first_words: tuple[int, int] | None = None,
) -> list[Conversation]:
    """`n` conversations of `turns` user messages of words[0]..words[1] random words each (the
    first one first_words[0]..[1], default the same: a chat that opens with a document or a
    long instruction, then goes on in short messages); a message opens with its conversation
    and turn, so no two conversations share a prefix past the chat template's own."""
    rng = random.Random(seed)

    def message(c: int, t: int) -> str:
        k = rng.randint(*(first_words if t == 0 and first_words else words))
        return f"Conversation {c}, message {t + 1}: " + " ".join(rng.choices(_WORDS, k=k))

    return [Conversation(c, tuple(message(c, t) for t in range(turns))) for c in range(n)]


# ---- results and statistics ------------------------------------------------------------------
@dataclass(slots=True)
class TurnResult:
    conversation: int
    turn: int  # 1-based
    ttft_s: float | None = None
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class Summary:
    turns: int  # turn >= min_turn results that succeeded
    errors: int  # of every turn
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    hit_rate: float | None  # cached / prompt tokens over the counted turns
    prompt_tokens: int


def summarize(results: list[TurnResult], min_turn: int = 2) -> Summary:
    ok = [r for r in results if r.error is None and r.turn >= min_turn]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    return Summary(
        turns=len(ok),
        errors=sum(r.error is not None for r in results),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        hit_rate=sum(r.cached_tokens for r in ok) / prompt if prompt else None,
        prompt_tokens=prompt,
    )


def ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off else None


# ---- one turn, one run -----------------------------------------------------------------------
async def chat_turn(http, url: str, model: str, conv: Conversation, max_tokens: int) -> TurnResult:
    """Send the conversation's next turn (streaming); on success its answer joins the history."""
    result = TurnResult(conv.index, len(conv.answers) + 1)
    body = {
        "model": model,
        "messages": conv.messages(),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            result.error = "stream ended without [DONE]"
            async for line in resp.aiter_lines():
                event = parse_sse_line(line, chat=True)
                if event is None:
                    continue
                if event.done or event.error:
                    result.error = event.error
                    break
                if event.text:
                    result.ttft_s = result.ttft_s or time.perf_counter() - t0
                    text.append(event.text)
                if event.usage:
                    result.prompt_tokens = int(event.usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(event.usage.get("completion_tokens") or 0)
                    details = event.usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
    except Exception as exc:  # a transport error ends this conversation, not the run
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - t0
    if result.error is None:
        conv.answers.append("".join(text))
    return result


async def run_conversations(
    url: str, model: str, conversations: list[Conversation], max_tokens: int, concurrency: int
) -> list[TurnResult]:
    import httpx

    results: list[TurnResult] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        warm = Conversation(-1, ("Say hello.",))
        if (await chat_turn(http, url, model, warm, 4)).error:  # first-request costs, unmeasured
            raise RuntimeError("the warm-up request failed")

        async def talk(conv: Conversation) -> None:
            async with gate:
                for _ in conv.user_messages:
                    results.append(r := await chat_turn(http, url, model, conv, max_tokens))
                    if r.error is not None:
                        return

        await asyncio.gather(*(talk(c) for c in conversations))
    return results


# ---- the run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunResult:
    config: str
    policy: str
    args: list[str]
    summary: Summary
    worker: dict[str, float]
    wall_s: float


def run_one(
    config: str, policy: str, args: list[str], model: str, opts: argparse.Namespace, work: Path
) -> RunResult:
    up_args = [
        "--model",
        model,
        "--router-arg=--enable-prompt-tokens-details",
        f"--router-arg=--policy={policy}",
        *args,
    ]
    print(f"[{config} / {policy}] pdserve up {' '.join(up_args)}", flush=True)
    cluster = Cluster(up_args, work / f"{config}-{policy}", opts.prefill, opts.decode)
    try:
        convs = build_conversations(
            opts.conversations, opts.turns, opts.user_words, opts.seed, opts.first_words
        )
        t0 = time.perf_counter()
        results = asyncio.run(
            run_conversations(cluster.url, model, convs, opts.max_tokens, opts.concurrency)
        )
        wall = time.perf_counter() - t0
        worker = cluster.worker_metrics()
    finally:
        cluster.stop()
    summary = summarize(results)
    errors = [r.error for r in results if r.error]
    if errors:
        print(f"  {len(errors)} turns failed, e.g. {errors[0]}", flush=True)
    return RunResult(config, policy, up_args, summary, worker, wall)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"x{x:.2f}"


def table(runs: list[RunResult]) -> str:
    lines = [
        f"{'config':7} {'placement':12} {'turns>=2':>8} {'TTFT p50 ms':>11} {'p99 ms':>8} "
        f"{'hit rate':>9} {'worker hits':>11} {'tier hit tok':>12} {'pulled blk':>10} "
        f"{'errors':>6} "
        f"{'wall s':>7}"
    ]
    for r in runs:
        s, w = r.summary, r.worker
        whr = (
            w["prefix_cache_hits"] / w["prefix_cache_queries"]
            if w["prefix_cache_queries"]
            else None
        )
        lines.append(
            f"{r.config:7} {r.policy:12} {s.turns:>8} {_ms(s.ttft_p50_ms):>11} "
            f"{_ms(s.ttft_p99_ms):>8} {_pct(s.hit_rate):>9} {_pct(whr):>11} "
            f"{w['tier_hit_tokens']:>12.0f} {w.get('pulled_blocks', 0):>10.0f} {s.errors:>6} "
            f"{r.wall_s:>7.1f}"
        )
    for policy, on, off in _pairs(runs):
        lines.append(
            f"on/off, {policy}: TTFT p50 {_x(ratio(on.ttft_p50_ms, off.ttft_p50_ms))}, "
            f"p99 {_x(ratio(on.ttft_p99_ms, off.ttft_p99_ms))}, hit rate "
            f"{_pct(off.hit_rate)} -> {_pct(on.hit_rate)}"
        )
    return "\n".join(lines)


def _pairs(runs: list[RunResult]) -> list[tuple[str, Summary, Summary]]:
    by = {(r.config, r.policy): r.summary for r in runs}
    return [
        (p, by["on", p], by["off", p])
        for p in dict.fromkeys(r.policy for r in runs)
        if ("on", p) in by and ("off", p) in by
    ]


def _words(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32, help="per answer")
    p.add_argument("--concurrency", type=int, default=4, help="conversations at once")
    p.add_argument(
        "--first-words",
        type=_words,
        default=(1000, 1500),
        metavar="MIN,MAX",
        help="words of a conversation's first user message (about one token each)",
    )
    p.add_argument(
        "--user-words",
        type=_words,
        default=(40, 120),
        metavar="MIN,MAX",
        help="words per later user message",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers")
    p.add_argument("--decode", type=int, default=2, help="decode workers")
    p.add_argument("--model", default="default", help="as `pdserve up --model`")
    p.add_argument("--policies", default="affinity,round_robin", help="router --policy values")
    p.add_argument("--configs", default="off,on")
    p.add_argument("--base-args", default=BASE_ARGS, help="pdserve up arguments of every run")
    p.add_argument(
        "--off-args",
        default=None,
        help="fabric off (default: --router-arg=--no-kv-pull where the router has it)",
    )
    p.add_argument(
        "--on-args",
        default=None,
        help=f"fabric on (default: --worker-arg={TIER}, and --router-arg=--kv-pull "
        "where the router has it)",
    )
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    return p.parse_args(argv)


def config_args(opts: argparse.Namespace, router: set[str]) -> dict[str, list[str]]:
    """Extra `pdserve up` arguments per configuration (the defaults follow what the router
    knows: --kv-pull is the peer pull's flag)."""
    pull = "--kv-pull" in router
    defaults = {
        "off": "--router-arg=--no-kv-pull" if pull else "",
        "on": f"--worker-arg={TIER}" + (" --router-arg=--kv-pull" if pull else ""),
    }
    given = {"off": opts.off_args, "on": opts.on_args}
    base = shlex.split(opts.base_args)
    return {
        c: base + shlex.split(given[c] if given[c] is not None else defaults[c])
        for c in opts.configs.split(",")
    }


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    from engine.models.prepare import resolve_model_path

    model = str(resolve_model_path(opts.model))
    router, up, worker = known_flags("router"), known_flags("up"), known_flags("decode")
    configs = config_args(opts, router)
    for name, args in configs.items():
        bad = unknown_flags(args, up, router, worker)
        if bad:
            print(
                f"multi_turn: configuration {name!r}: unknown flag(s) {' '.join(bad)} "
                "(not in the --help of pdserve up / router / decode of this checkout)",
                file=sys.stderr,
            )
            return 2
    isa = cpu_isa()
    print(
        f"{opts.prefill}P+{opts.decode}D; {opts.conversations} conversations x {opts.turns} "
        f"turns, max_tokens "
        f"{opts.max_tokens}, concurrency {opts.concurrency}; {os.cpu_count()} cores, {isa}; "
        f"peer pull {'in' if '--kv-pull' in router else 'NOT in'} this checkout",
        flush=True,
    )
    runs = []
    with tempfile.TemporaryDirectory(prefix="multi-turn-") as tmp:
        for policy in opts.policies.split(","):
            for name, args in configs.items():
                runs.append(run_one(name, policy, args, model, opts, Path(tmp)))
                print(table(runs[-1:]).splitlines()[1], flush=True)
    print(table(runs))
    if opts.json is not None:
        opts.json.write_text(
            json.dumps(
                {
                    "isa": isa,
                    "cores": os.cpu_count(),
                    "peer_pull": "--kv-pull" in router,
                    "options": {k: v for k, v in vars(opts).items() if k != "json"},
                    "runs": [asdict(r) for r in runs],
                    "ratios": {
                        p: {
                            "ttft_p50": ratio(on.ttft_p50_ms, off.ttft_p50_ms),
                            "ttft_p99": ratio(on.ttft_p99_ms, off.ttft_p99_ms),
                            "hit_rate": ratio(on.hit_rate, off.hit_rate),
                        }
                        for p, on, off in _pairs(runs)
                    },
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
