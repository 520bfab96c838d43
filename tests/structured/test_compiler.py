"""GrammarCompiler against the default model's tokenizer: a repeat is a cache hit, concurrent
requests for one constraint share one compile, compiles run on the pool's threads, a constraint
xgrammar refuses is a ValueError naming the field (and is not cached), a compile past the deadline
is a ValueError, too many compiles in flight is GrammarBusyError, the cache is a bounded LRU, and
a compile that ends before ``submit`` returns does not deadlock it.
Slow compiles are faked by replacing ``_compile_now`` on the instance with one that waits."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
from tiny_models import smollm2_tokenizer

from engine.structured.compiler import COMPILE_THREADS, GrammarBusyError, GrammarCompiler
from engine.structured.params import StructuredOutputs

VOCAB = 49152
A = StructuredOutputs(regex="[0-9]{3}")
B = StructuredOutputs(choice=("yes", "no"))
C = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture
def make(tokenizer):
    made = []

    def build(**limits):
        c = GrammarCompiler(tokenizer, VOCAB, **limits)
        made.append(c)
        return c

    yield build
    for c in made:
        c.close()


class Gate:
    """A fake ``_compile_now``: counts its calls and holds each until ``release``."""

    def __init__(self, real):
        self.real, self.calls, self.started = real, [], threading.Semaphore(0)
        self.open = threading.Event()

    def __call__(self, so):
        self.calls.append(so)
        self.started.release()
        assert self.open.wait(30)
        return self.real(so)

    def release(self):
        self.open.set()


def gated(compiler) -> Gate:
    gate = Gate(compiler._compile_now)
    compiler._compile_now = gate
    return gate


def test_repeat_is_a_cache_hit(make):
    c = make()
    first = c.compile(A)
    assert c.compile(StructuredOutputs(regex="[0-9]{3}")) is first  # an equal constraint
    assert (c.compiles, c.hits) == (1, 1)
    assert c.compile(B) is not first and c.compiles == 2


def test_concurrent_requests_for_one_constraint_share_one_compile(make):
    c = make()
    gate = gated(c)
    results = [None] * 6
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, c.compile(C))) for i in range(6)
    ]
    for t in threads:
        t.start()
    assert gate.started.acquire(timeout=30)
    gate.release()
    for t in threads:
        t.join(30)
    assert len(gate.calls) == 1 and c.compiles == 1 and c.hits == 5
    assert all(r is results[0] for r in results) and results[0] is not None


def test_compiles_run_on_the_pool_threads_at_once(make):
    c = make()
    assert COMPILE_THREADS == 2
    gate = gated(c)
    futures = [c.submit(A), c.submit(B), c.submit(C)]
    # Two start together (the pool's two threads); the third waits for a free thread.
    assert gate.started.acquire(timeout=30) and gate.started.acquire(timeout=30)
    assert not gate.started.acquire(timeout=0.3)
    assert len(gate.calls) == 2
    gate.release()
    assert all(f.result(30) is not None for f in futures) and len(gate.calls) == 3


@pytest.mark.parametrize(
    "so, message",
    [
        (StructuredOutputs(regex="(ab"), "structured_outputs.regex could not be compiled: .*paren"),
        (StructuredOutputs(grammar="root ::= ("), "structured_outputs.grammar could not be"),
        (StructuredOutputs(grammar="start: x"), "structured_outputs.grammar could not be"),
        (StructuredOutputs(json={"type": "nonsense"}), "structured_outputs.json could not be"),
        (StructuredOutputs(json={"$ref": "#/defs/x"}), "structured_outputs.json could not be"),
    ],
)
def test_bad_constraint_is_a_value_error_naming_the_field(make, so, message):
    c = make()
    with pytest.raises(ValueError, match=message) as info:
        c.compile(so)
    assert not info.value.args[0].startswith("[")  # xgrammar's log prefix stripped
    with pytest.raises(ValueError, match=message):
        c.compile(so)  # a failure is not cached: it compiles (and fails) again
    assert c.compiles == 2 and c.hits == 0


def test_deadline_is_a_value_error_and_the_compile_is_kept(make):
    c = make(timeout=0.05)
    gate = gated(c)
    with pytest.raises(ValueError, match=r"structured_outputs\.json did not compile within 0\.05"):
        c.compile(C)
    with pytest.raises(ValueError, match="did not compile within"):
        asyncio.run(c.compile_async(C))
    gate.release()
    assert c.compile(C, timeout=30) is not None  # the same compile, finished meanwhile
    assert len(gate.calls) == 1


def test_too_many_pending_is_busy_but_a_shared_one_is_not(make):
    c = make(max_pending=2)
    gate = gated(c)
    c.submit(A)
    c.submit(B)
    with pytest.raises(GrammarBusyError, match="2 grammar compiles are in flight .* limit is 2"):
        c.submit(C)
    c.submit(A)  # in flight already: shared, not refused
    gate.release()
    assert c.compile(A) is not None and c.compile(B) is not None
    assert c.compile(C) is not None  # room again once they ended
    assert len(gate.calls) == 3


def test_cache_is_a_bounded_lru(make):
    c = make(cache_size=2)
    a = c.compile(A)
    c.compile(B)
    assert c.compile(A) is a  # A is now the most recent
    c.compile(C)  # evicts B, the least recent
    assert c.compile(A) is a
    n = c.compiles
    c.compile(B)
    assert c.compiles == n + 1  # B compiled again
    assert len(c._cache) == 2


def test_compile_async_awaits_the_pool(make):
    c = make()

    async def main():
        ticks = 0
        task = asyncio.ensure_future(c.compile_async(C))
        while not task.done():  # the loop keeps running while the pool compiles
            ticks += 1
            await asyncio.sleep(0)
        return await task, ticks

    compiled, ticks = asyncio.run(main())
    assert compiled is c.compile(C) and ticks >= 1


class InlinePool:
    """A pool whose compiles have ended by the time ``submit`` returns (as a fast one can)."""

    def submit(self, fn, *args):
        fut = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def shutdown(self, **kw):
        pass


@pytest.mark.parametrize("so", [A, StructuredOutputs(regex="(ab")], ids=["ok", "fails"])
def test_a_compile_done_before_its_callback_is_added_does_not_deadlock(make, so):
    c = make()
    c._pool = InlinePool()
    results = []

    def go():
        try:
            results.append(c.compile(so))
        except ValueError as exc:
            results.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "submit deadlocked on its own lock"
    assert len(results) == 1 and c._pending == 0
