"""Speculative-decoding benchmark (docs/spec_decode.md). Decode tokens/s with and
without speculation, measured in one run, interleaved (baseline, each method, baseline, ...);
prints numbers, ratios against that same-run baseline, acceptance, and whether each spec
run's tokens equal the baseline's token for token. Asserts nothing.

  python benchmarks/spec_decode_bench.py [--quick] [--reps 2] [--self-layers 8,10]

Workloads, each single-sequence and batch-8, greedy:
- copy: a chat asking to rewrite a ~200-token paragraph with typos fixed (copy-heavy);
- free: "Write a short story about ..." (free generation).
Plus one random-sampling row (temperature 0.8, seeded): copy, single sequence.

Methods: ngram (prompt lookup), draft_model `self:N` (the target's first N layers), each
against no speculation. Decode tok/s counts the tokens produced after the step in which
the last sequence of the batch got its first token, over the time from that step to the
end (so prefill is excluded; the warm-up run leaves the prompts in the prefix cache).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from cpu_info import cpu_isa

from engine import LLM, SamplingParams

PARAGRAPHS = (
    "The old lighthouse stood at the edge of the cliff for more then two hundred years. Every "
    "night its keeper climbed the narow stairs, cleaned the great lens and lit the lamp, so "
    "that the fishing boats coming home in the dark could find the harbour. When the town "
    "installed an automatic light, the keeper was told he was no longer needed. He refused to "
    "leave. He said the sea had not changed, and that a machine could not see the fog rolling "
    "in the way a person could. The town council argued about it for a whole winter. In the "
    "end they let him stay, on the condition that he would also look after the small museum "
    "that was opened in the keepers cottage, where visitors could learn about the storms, the "
    "shipwrecks and the familys who had lived there before him.",
    "Bread is one of the oldest prepared foods. To make a simple loaf you need flour, water, "
    "salt and yeast. Mix the flour and the salt in a large bowl, then dissolve the yeast in "
    "warm water and pour it in. Stir until a rough dough forms, then knead it on a floured "
    "surface for about ten minuts, until it is smooth and elastic. Put the dough back in the "
    "bowl, cover it with a cloth and let it rise in a warm place untill it has doubled in "
    "size, which usually takes an hour or two. Shape it into a loaf, let it rise again, and "
    "bake it in a hot oven for thirty to fourty minutes. The loaf is done when it sounds "
    "hollow if you tap the bottom. Let it cool before you cut it, or the inside will be "
    "gummy.",
    "Our team meeting on Tuesday covered three topics. First, the new office will open in "
    "March, and everyone who wants to move should tell their manager before the end of the "
    "month. Second, the budget for next year was aproved, with more money for training and "
    "for new laptops, but less for travel. Third, we discussed the customer survey. Most "
    "customers are happy with the product, but many said that the documentation is hard to "
    "follow and that support takes too long to anwser. We agreed to hire two more support "
    "engineers and to rewrite the getting started guide. Anna will lead the documentation "
    "work and Tom will organise the hiring. The next meeting is on the first Tuesday of next "
    "month, at the same time and in the same room as usual.",
    "Honey bees live in colonies of many thousands of workers, a few hundred males and a "
    "single queen. The workers are all female. Young workers stay inside the hive, where they "
    "clean the cells, feed the larvae and build wax comb. Older workers fly out to collect "
    "nectar and pollen from flowers, sometimes travelling several kilometers from the hive. "
    "When a forager finds a good patch of flowers, she returns and performs a dance that "
    "tells the other bees the direction and the distance to the food. The nectar is stored "
    "in the comb and slowly turned into honey as the water evaporates. A strong colony can "
    "produce far more honey then it needs to survive the winter, which is why people have "
    "kept bees for thousands of years.",
)
INSTRUCTIONS = (
    "Rewrite the following text, fixing the typos:",
    "Copy the text below and correct its spelling mistakes:",
)
STORY_TOPICS = (
    "a robot who learns to paint",
    "a lost dog finding its way home",
    "a girl who can talk to trees",
    "the last train of the night",
    "a dragon afraid of the dark",
    "two friends building a boat",
    "a city where it never stops raining",
    "a clock that runs backwards",
)


@dataclass(frozen=True)
class Method:
    name: str
    spec: dict[str, Any] | None  # speculative_config; None = no speculation (the baseline)


@dataclass(frozen=True)
class Case:
    name: str  # workload x batch x sampling
    prompts: list[list[int]]
    params: list[SamplingParams]


@dataclass
class RunResult:
    token_ids: list[list[int]]
    decode_tokens: int
    decode_seconds: float
    decode_steps: int
    draft_seconds: float  # in the proposer, decode window only
    drafts: int = 0  # verify steps with drafts (engine.stats() counters, this run's share)
    draft_tokens: int = 0
    accepted: int = 0


@dataclass
class Totals:
    """One (case, method) summed over the repetitions."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    draft_seconds: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    output_tokens: int = 0  # whole runs, every sequence
    mismatches: list[str] = field(default_factory=list)  # "rep r seq i @ token j"
    rates: list[float] = field(default_factory=list)  # decode tok/s of each rep

    def add(self, r: RunResult, mismatch: str | None) -> None:
        self.tokens += r.decode_tokens
        self.seconds += r.decode_seconds
        self.rates.append(r.decode_tokens / r.decode_seconds)
        self.output_tokens += sum(map(len, r.token_ids))
        self.steps += r.decode_steps
        self.draft_seconds += r.draft_seconds
        self.drafts += r.drafts
        self.draft_tokens += r.draft_tokens
        self.accepted += r.accepted
        if mismatch:
            self.mismatches.append(mismatch)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def make_cases(llm: LLM, batch: int, max_tokens: int) -> list[Case]:
    chat = lambda text: llm.tokenizer.encode_chat([{"role": "user", "content": text}])  # noqa: E731
    copy = [
        chat(f"{INSTRUCTIONS[i // len(PARAGRAPHS) % 2]}\n\n{PARAGRAPHS[i % len(PARAGRAPHS)]}")
        for i in range(batch)
    ]
    free = [
        chat(f"Write a short story about {STORY_TOPICS[i % len(STORY_TOPICS)]}.")
        for i in range(batch)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    cases = []
    for name, prompts in (("copy", copy), ("free", free)):
        cases.append(Case(f"{name} x1 greedy", prompts[:1], [greedy]))
        cases.append(Case(f"{name} x{batch} greedy", prompts, [greedy] * batch))
    sampled = SamplingParams(temperature=0.8, seed=1234, max_tokens=max_tokens)
    cases.append(Case("copy x1 T=0.8 seeded", copy[:1], [sampled]))
    return cases


def run(llm: LLM, case: Case, tag: str) -> RunResult:
    """Drive the engine over the case's prompts (as LLM.generate does), timing each step."""
    engine = llm.engine
    before = engine.stats()
    ids = [f"{tag}-{i}" for i in range(len(case.prompts))]
    for rid, prompt, params in zip(ids, case.prompts, case.params):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    draft_time = [0.0]
    proposer = engine.proposer
    if proposer is not None:
        propose = proposer.propose

        def timed_propose(batch):
            t = time.perf_counter()
            out = propose(batch)
            draft_time[0] += time.perf_counter() - t
            return out

        proposer.propose = timed_propose
    t_decode = None
    tokens_at_decode = steps_at_decode = steps = 0
    draft_at_decode = 0.0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
        steps += 1
        if t_decode is None and all(tokens.values()):  # every sequence has its first token
            t_decode = time.perf_counter()
            tokens_at_decode = sum(map(len, tokens.values()))
            steps_at_decode, draft_at_decode = steps, draft_time[0]
    end = time.perf_counter()
    if proposer is not None:
        del proposer.propose  # the class's method again
    after = engine.stats()
    return RunResult(
        token_ids=[tokens[rid] for rid in ids],
        decode_tokens=sum(map(len, tokens.values())) - tokens_at_decode,
        decode_seconds=end - t_decode,
        decode_steps=steps - steps_at_decode,
        draft_seconds=draft_time[0] - draft_at_decode,
        drafts=after.spec_num_drafts - before.spec_num_drafts,
        draft_tokens=after.spec_num_draft_tokens - before.spec_num_draft_tokens,
        accepted=after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
    )


def first_mismatch(reference: list[list[int]], got: list[list[int]]) -> str | None:
    """Where `got` first differs from `reference` ("seq i @ token j"), or None if equal."""
    for i, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"seq {i} @ token {j}"
    return None


def make_methods(args) -> list[Method]:
    ngram = {
        "method": "ngram",
        "num_speculative_tokens": args.ngram_k,
        "prompt_lookup_max": args.lookup_max,
    }
    methods = [Method("no spec", None), Method(f"ngram k={args.ngram_k}", ngram)]
    for n in (int(x) for x in args.self_layers.split(",") if x):
        methods.append(
            Method(
                f"self:{n} k={args.draft_k}",
                {
                    "method": "draft_model",
                    "model": f"self:{n}",
                    "num_speculative_tokens": args.draft_k,
                },
            )
        )
    return methods


def bench(args) -> dict[tuple[str, str], Totals]:
    """Every (case, method) run `args.reps` times, interleaved; the totals, printed."""
    methods = make_methods(args)
    engines = {
        m.name: LLM(
            args.model,
            dtype=args.dtype,
            num_layers=args.num_layers,
            kv_cache_memory=args.kv_memory,
            speculative_config=m.spec,
        )
        for m in methods
    }
    base = engines[methods[0].name]
    cases = make_cases(base, args.batch, args.max_tokens)
    print(
        f"{cpu_isa()}; model {args.model} ({base.engine.loaded.args.n_layers} layers), dtype "
        f"{base.engine.dtype}, {torch.get_num_threads()} torch thread(s), max_tokens "
        f"{args.max_tokens}, {args.reps} rep(s); prompt tokens: copy {len(cases[0].prompts[0])}, "
        f"free {len(cases[2].prompts[0])}"
    )
    short = SamplingParams(temperature=0.0, max_tokens=4)
    for m in methods:  # warm-up: one short run per engine and case (fills the prefix cache)
        for case in cases:
            run(engines[m.name], Case(case.name, case.prompts, [short] * len(case.prompts)), "warm")
    totals = {(c.name, m.name): Totals() for c in cases for m in methods}
    for rep in range(args.reps):
        for case in cases:
            reference = None
            for m in methods:
                r = run(engines[m.name], case, f"r{rep}")
                reference = reference or r.token_ids
                mismatch = first_mismatch(reference, r.token_ids)
                totals[(case.name, m.name)].add(r, mismatch and f"rep {rep + 1} {mismatch}")
            print(f"rep {rep + 1}/{args.reps} {case.name}: done", flush=True)
    report(cases, methods, totals)
    return totals


def report(cases: list[Case], methods: list[Method], totals: dict[tuple[str, str], Totals]) -> None:
    print(
        f"\n{'case':22s} {'method':12s} {'decode tok/s':>12s} {'ratio':>6s} {'ms/step':>8s} "
        f"{'draft ms':>8s} {'accept':>7s} {'mean len':>8s} {'drafts':>6s}  {'per-rep ratios':14s} "
        f"identical to no spec"
    )
    for case in cases:
        base = totals[(case.name, methods[0].name)]
        print(
            f"-- {case.name}: {base.output_tokens / len(base.rates) / len(case.prompts):.0f} "
            f"output tokens per sequence (mean of a run)"
        )
        for m in methods:
            t = totals[(case.name, m.name)]
            accept = f"{t.accepted / t.draft_tokens:7.1%}" if t.draft_tokens else f"{'-':>7s}"
            length = f"{1 + t.accepted / t.drafts:8.2f}" if t.drafts else f"{'-':>8s}"
            per_rep = " ".join(f"{a / b:.2f}" for a, b in zip(t.rates, base.rates))
            same = "yes" if not t.mismatches else "NO: " + "; ".join(t.mismatches)
            print(
                f"{case.name:22s} {m.name:12s} {t.rate:12.1f} {t.rate / base.rate:5.2f}x "
                f"{t.seconds / t.steps * 1000:8.1f} {t.draft_seconds / t.steps * 1000:8.1f} "
                f"{accept} {length} {t.drafts:6d}  {per_rep:14s} {same}"
            )


def main(argv: list[str] | None = None) -> dict[tuple[str, str], Totals]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--ngram-k", type=int, default=4)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--draft-k", type=int, default=3)
    parser.add_argument(
        "--self-layers", default="8,10", help="N of each draft_model self:N, comma-separated"
    )
    parser.add_argument("--kv-memory", type=int, default=1 << 30)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: ratios stay stable when another process holds a core)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 layers, 16 tokens, 1 rep, 64 MiB KV pools: a smoke run",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.num_layers, args.max_tokens, args.reps, args.self_layers = 2, 16, 1, "1"
        args.kv_memory = 64 << 20
    torch.set_num_threads(args.threads)
    return bench(args)


if __name__ == "__main__":
    main()
