"""Tool-calling benchmark (docs/benchmarks/structured.md). Prints numbers and ratios; asserts
nothing.

  python benchmarks/tool_calls.py [--batch 16] [--steps 24] [--reps 2] [--prompts 24]

1. Constrained tool calls per decode step: a batch decodes `--steps` steps (prefill
   excluded; time per token made x batch, as a row whose grammar completes leaves early)
   unconstrained, under tool_choice "required" (the JSON array of calls), and under
   "auto" with the hermes parser's structural tag (free text until `<tool_call>`), interleaved
   in one run; the ratio to unconstrained is what the constraint costs per step.
2. How often "auto" yields a call that parses, on the bundled model with the ChatML tool
   template (examples/tool_chat_template_chatml.jinja) and the hermes parser: `--prompts`
   requests that ask for something a tool answers, greedy, with and without the structural
   tag. Small models call tools badly; the prompts are plain requests, not tuned to hide it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jsonschema
import torch

from engine import LLM, SamplingParams
from router.parsers.message import MessageParser, OutputSetup, required_calls_schema
from router.parsers.tools.parser import tool_parser
from router.parsers.tools.types import FunctionTool, assemble

REPO = Path(__file__).resolve().parents[1]
TOOLS = [
    FunctionTool(
        "get_weather",
        "Current weather in a city",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    ),
    FunctionTool(
        "get_time",
        "Current time in a time zone",
        {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    ),
    FunctionTool(
        "search",
        "Search the web",
        {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    ),
]
ASKS = [
    "What's the weather in {}?",
    "Is it raining in {} right now?",
    "What time is it in {}?",
    "Search the web for the population of {}.",
    "How warm is it in {} today, in celsius?",
    "Look up the history of {}.",
]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Denver", "Hanoi"]


def _prompts(count: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(CITIES[i % len(CITIES)]) for i in range(count)]


def _constraints() -> dict[str, dict | None]:
    hermes = tool_parser("hermes")
    return {
        "plain": None,
        "required": {"json": required_calls_schema(TOOLS, True)},
        "auto (hermes tag)": {"structural_tag": json.dumps(hermes.structural_tag(TOOLS))},
    }


def _step_time(llm: LLM, prompt: list[int], batch: int, steps: int, constraint) -> float:
    """Seconds per decode step of a full batch: the measured steps' time over the tokens they
    made, times the batch (a row whose grammar completes leaves the batch early)."""
    engine = llm.engine
    params = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=steps + 2,
        ignore_eos=True,
        structured_outputs=constraint,
    )
    for i in range(batch):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", prompt, params)
    requests = list(engine.scheduler.requests.values())
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    before = sum(r.num_output_tokens for r in requests)
    t0, done = time.perf_counter(), 0
    while engine.has_unfinished_requests() and done < steps:
        engine.step()
        done += 1
    elapsed = time.perf_counter() - t0
    made = sum(r.num_output_tokens for r in requests) - before
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / max(made, 1) * batch


def _auto_share(llm: LLM, prompts: list[list[int]], tag: dict | None) -> tuple[int, int, int]:
    """(outputs with a call that parses and follows its schema, outputs that started a call
    marker, prompts)."""
    params = SamplingParams(
        temperature=0,
        max_tokens=96,
        structured_outputs={"structural_tag": json.dumps(tag)} if tag else None,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    setup = OutputSetup(tools=tuple(TOOLS), tool_choice="auto", parser=tool_parser("hermes"))
    schemas = {t.name: t.parameters for t in TOOLS}
    good = started = 0
    for out in outs:
        text = out.outputs[0].text
        parser = MessageParser(setup)
        calls = assemble(parser.feed(text).extend(parser.finish()).tool_calls)
        started += "<tool_call>" in text
        try:
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            good += bool(calls)
        except (ValueError, jsonschema.ValidationError, KeyError):
            pass
    return good, started, len(outs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=1 << 30)
    tok = llm.engine.tokenizer
    tok.set_chat_template((REPO / "examples" / "tool_chat_template_chatml.jinja").read_text())
    tools = [t.to_openai() for t in TOOLS]

    def render(text: str) -> list[int]:
        return tok.encode(tok.render_chat([{"role": "user", "content": text}], True, tools=tools))

    constraints = _constraints()
    prompt = render(_prompts(1)[0])
    for c in constraints.values():  # warm-up: compiles, first forwards at this batch
        _step_time(llm, prompt, args.batch, 4, c)
    print(
        f"dtype {llm.engine.dtype}, {args.threads} thread(s), batch {args.batch}, "
        f"{args.steps} decode steps per run, {args.reps} interleaved reps"
    )
    times: dict[str, list[float]] = {name: [] for name in constraints}
    for _ in range(args.reps):
        for name, c in constraints.items():
            times[name].append(_step_time(llm, prompt, args.batch, args.steps, c))
    plain = min(times["plain"])
    for name, ts in times.items():
        print(f"  {name:18s} {min(ts) * 1000:8.1f} ms/step   x{min(ts) / plain:.3f} of plain")

    prompts = [render(p) for p in _prompts(args.prompts)]
    tag = tool_parser("hermes").structural_tag(TOOLS)
    for name, t in (("auto, unconstrained", None), ("auto, hermes tag", tag)):
        good, started, total = _auto_share(llm, prompts, t)
        print(
            f"  {name:22s} calls that parse and follow the schema: {good}/{total} "
            f"({100 * good / total:.0f}%), outputs that began a call: {started}/{total}"
        )


if __name__ == "__main__":
    main()
