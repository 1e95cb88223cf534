"""Grammar compiles are shared fairly and never wait unbounded (engine/structured/fair_slots.py),
and nested counted repetitions are refused before any compile (engine/structured/repetition.py):
one tenant's pile of compiles delays another's by at most the compile it is running; fresh
tenants cannot overtake one already waiting; a caller without a slot in time gets CompileBusy
(a worker's RESOURCE_EXHAUSTED) and leaves nothing queued; a cancelled waiter gives back what
it was granted; the worker's GrammarCompiler applies all of it (turns by tenant, the wait
bound, the repetition limit) before its compile process sees a constraint."""

import asyncio
import threading
import time

import grpc
import pytest

from engine.checks import FieldError
from engine.processing.tokenizer import Tokenizer
from engine.structured.compile_process import CompileLimits
from engine.structured.compiler import GrammarCompiler
from engine.structured.fair_slots import CompileBusy, FairSlots
from engine.structured.params import StructuredOutputsParams as Params
from engine.structured.repetition import check_repetitions, ebnf_bound, regex_bound
from worker_runtime.grpc_errors import status_for

pytestmark = pytest.mark.timeout(120)


def _queued(slots: FairSlots, tenant: str, started: list) -> threading.Thread:
    """A thread that takes a slot in `tenant`'s turn, records it, and holds it until told."""

    def run() -> None:
        slots.acquire(tenant)
        started.append(tenant)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_a_pile_of_one_tenant_delays_another_by_one_compile():
    slots = FairSlots(1, wait_s=30)
    slots.acquire("A")  # A's first compile runs
    started: list = []
    threads = [_queued(slots, "A", started) for _ in range(3)]
    _until(lambda: slots.waiting() == 3)
    threads.append(_queued(slots, "B", started))
    _until(lambda: slots.waiting() == 4)
    for _ in range(4):  # each compile ends in turn
        slots.release()
        _until(lambda n=len(started): len(started) > n)
    for t in threads:
        t.join()
    assert list(slots.granted_to) == ["A", "B", "A", "A", "A"]
    assert started == ["B", "A", "A", "A"]


def test_tenants_take_turns_and_fresh_ones_cannot_overtake_a_waiter():
    slots = FairSlots(1, wait_s=30)
    slots.acquire("A")
    started: list = []
    threads = [_queued(slots, "A", started) for _ in range(2)]
    _until(lambda: slots.waiting() == 2)
    threads.append(_queued(slots, "B", started))
    _until(lambda: slots.waiting() == 3)
    for tenant in ("C", "D"):  # arrive after B: served after B, and before A's second
        threads.append(_queued(slots, tenant, started))
        _until(lambda n=len(threads): slots.waiting() == n)
    for _ in range(len(threads)):
        slots.release()
        _until(lambda n=len(started): len(started) > n)
    for t in threads:
        t.join()
    assert started == ["B", "C", "D", "A", "A"]


def test_no_slot_in_time_is_compile_busy_and_leaves_nothing_queued():
    slots = FairSlots(1, wait_s=0.1)
    slots.acquire("A")
    with pytest.raises(CompileBusy, match="--grammar-compile-wait") as busy:
        slots.acquire("B")
    assert busy.value.wait_s == 0.1 and slots.waiting() == 0
    assert status_for(busy.value) == grpc.StatusCode.RESOURCE_EXHAUSTED  # on a worker
    slots.release()
    slots.acquire("B")  # the slot is free again: no ghost waiter took it
    assert list(slots.granted_to) == ["A", "B"]


def test_async_waiters_time_out_and_a_cancelled_one_gives_back_its_slot():
    async def main():
        slots = FairSlots(1, wait_s=0.1)
        await slots.acquire_async("A")
        with pytest.raises(CompileBusy):
            await slots.acquire_async("B")
        assert slots.waiting() == 0
        slots.wait_s = 30
        waiter = asyncio.ensure_future(slots.acquire_async("B"))
        await asyncio.sleep(0.01)
        assert slots.waiting() == 1
        waiter.cancel()  # the client left while it waited: withdrawn
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert slots.waiting() == 0
        granted = asyncio.ensure_future(slots.acquire_async("C"))
        await asyncio.sleep(0.01)
        slots.release()  # C is granted, but cancelled before it runs: the slot comes back
        granted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await granted
        await asyncio.wait_for(slots.acquire_async("D"), 5)
        assert list(slots.granted_to) == ["A", "C", "D"]

    asyncio.run(main())


@pytest.mark.parametrize(
    "regex, bound",
    [
        ("[0-9]+", 1),
        (r"\d{1,1000}", 1000),
        ("(a{1,50}){1,50}", 2500),
        ("(((ab|a){0,20}){0,20}){0,20}", 8000),
        ("a{900}b{900}", 900),  # a sequence does not multiply
        ("((ab|a)*){0,100}", 100),  # a star counts 1
        ("(a{2,}){3}", 6),  # an open end counts its lower bound
        (r"[{}0-9]{3}\{5\}", 3),  # braces in a class or escaped are literals
        ("(?:x{10}|y{20}){30}", 600),
        ("a{" + "9" * 5000 + "}", 1 << 62),  # no 5000-digit int
    ],
)
def test_regex_bounds(regex, bound):
    assert regex_bound(regex) == bound


def test_grammar_and_schema_bounds_multiply_through_what_they_nest():
    assert ebnf_bound('root ::= item{1,50}\nitem ::= "a"{1,50} | "{"\n# {1000} in a comment') == (
        2500
    )
    assert ebnf_bound('root ::= x{10}\nx ::= root{10} | "a"') == 100  # a cycle counts once
    schema = {"type": "object", "properties": {"z": {"type": "string", "pattern": "(a{9}){9}"}}}
    assert check_repetitions(Params(json=schema), 81) is None
    with pytest.raises(FieldError) as refused:
        check_repetitions(Params(json=schema), 80)
    assert refused.value.field == "json"
    assert "multiply to 81 copies" in str(refused.value)
    assert "--max-grammar-repetitions" in str(refused.value)
    tag = '{"type": "structural_tag", "format": {"type": "regex", "pattern": "(b{40}){40}"}}'
    with pytest.raises(FieldError, match="1600 copies"):
        check_repetitions(Params(structural_tag=tag), 1000)
    check_repetitions(Params(regex="(a{1,50}){1,50}"), 0)  # 0: no limit


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


def test_the_worker_compiler_takes_turns_waits_bounded_and_refuses_repetitions(
    tokenizer, monkeypatch
):
    compiler = GrammarCompiler(
        tokenizer,
        tokenizer.vocab_size,
        tokenizer.stop_token_ids,
        CompileLimits(timeout_s=5, processes=1, wait_s=30, max_repetitions=1000),
    )
    ran, gate = [], threading.Event()
    compiled = compiler._compile_miss

    def compile_miss(params):  # the compile process: a "slow" one holds it until the gate opens
        ran.append(params.regex)
        if params.regex.startswith("slow"):
            gate.wait(30)
        return compiled(params)

    monkeypatch.setattr(compiler, "_compile_miss", compile_miss)

    def ask(regex: str, tenant: str) -> threading.Thread:
        thread = threading.Thread(target=compiler.compile, args=(Params(regex=regex), tenant))
        thread.start()
        return thread

    try:
        with pytest.raises(FieldError, match="multiply to 2500 copies") as refused:
            compiler.compile(Params(regex="(a{1,50}){1,50}"), "A")
        assert refused.value.field == "regex" and ran == []  # refused before any compile

        threads = [ask("slow0", "A")]
        _until(lambda: ran == ["slow0"])
        threads += [ask(f"slow{i}", "A") for i in (1, 2, 3)]
        _until(lambda: compiler._slots.waiting() == 3)
        threads.append(ask("b0", "B"))
        _until(lambda: compiler._slots.waiting() == 4)
        gate.set()
        for t in threads:
            t.join()
        assert ran.index("b0") == 1, ran  # only A's running compile before it

        gate.clear()  # A's next compile holds the one process past B's wait bound
        holder = ask("slow4", "A")
        _until(lambda: ran[-1] == "slow4")
        compiler._slots.wait_s = 0.1
        with pytest.raises(CompileBusy):
            compiler.compile(Params(regex="b1"), "B")
        gate.set()
        holder.join()
        compiler.compile(Params(regex="b1"), "B")  # a busy refusal is not cached
        assert ran[-1] == "b1"
    finally:
        gate.set()
        compiler.close()
