"""Constraints compiled into grammars against one tokenizer, by xgrammar, on a bounded pool.

xgrammar, not llguidance: it is what vLLM and SGLang use by default, it runs on the CPU, it
computes the token bitmask of a step in microseconds from masks it precomputes per grammar state,
and its bitmask kernels cover CPU tensors, CUDA and Triton (the GPU path takes them as they are).

A compile happens once per distinct constraint: results sit in an LRU cache of
``cache_size`` entries, and concurrent requests for the same constraint share one compile.
Compiles run on ``threads`` pool threads, never on the caller's (an event loop, the engine's step
loop), and the caller waits at most ``timeout`` seconds: a constraint that takes longer is
refused with a RequestError naming the field, and at most ``max_pending`` compiles may be queued
or running at once. A thread cannot be stopped, so a runaway compile keeps its pool thread until
it ends; the size caps in params.py keep that rare and short.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from engine.errors import RequestError
from engine.structured.params import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

    from engine.model.tokenizer import Tokenizer

logger = logging.getLogger("engine")

COMPILE_THREADS = 2
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256
MAX_PENDING = 16


class GrammarBusyError(RuntimeError):
    """Too many compiles in flight: retry later (the servers answer 503)."""


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's view of our tokenizer: every token's vocabulary spelling, the vocabulary's
    kind (byte-level BPE, SentencePiece byte fallback, raw) read from the ``tokenizers``
    backend's own description, and the tokens that end generation. ``vocab_size`` is the
    model's (the logits' width); ids past the tokenizer's are never allowed."""
    import xgrammar as xgr

    backend = tokenizer.backend
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    encoded = [""] * max(vocab_size, tokenizer.vocab_size)
    for piece, i in backend.get_vocab(with_added_tokens=True).items():
        encoded[i] = piece
    return xgr.TokenizerInfo(
        encoded,
        meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(tokenizer.eos_token_ids),
        add_prefix_space=meta["add_prefix_space"],
    )


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        threads: int = COMPILE_THREADS,
        timeout: float = COMPILE_TIMEOUT_S,
        cache_size: int = CACHE_SIZE,
        max_pending: int = MAX_PENDING,
    ) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size)
        # xgrammar's own cache is off: ours is keyed by the whole constraint and bounded.
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.timeout = timeout
        self.cache_size = cache_size
        self.max_pending = max_pending
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "grammar-compile")
        # Reentrant: a compile that ends before ``submit`` adds its callback (a fast failure)
        # runs ``_done`` at once, in ``submit``, under the lock.
        self._lock = threading.RLock()
        self._cache: OrderedDict[StructuredOutputs, concurrent.futures.Future] = OrderedDict()
        self._pending = 0
        self.compiles = 0  # compiles run (cache misses)
        self.hits = 0

    def submit(self, so: StructuredOutputs) -> concurrent.futures.Future:
        """A future of the compiled grammar: a cached or in-flight one when there is one."""
        with self._lock:
            fut = self._cache.get(so)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(so)
                self.hits += 1
                return fut
            if self._pending >= self.max_pending:
                raise GrammarBusyError(
                    f"{self._pending} grammar compiles are in flight (the limit is "
                    f"{self.max_pending}); retry later"
                )
            self._pending += 1
            self.compiles += 1
            fut = self._pool.submit(self._compile, so)
            fut.add_done_callback(self._done)
            self._cache[so] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _done(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending -= 1

    def compile(self, so: StructuredOutputs, timeout: float | None = None):
        """The compiled grammar, waiting at most ``timeout`` (default: the compiler's)."""
        fut = self.submit(so)
        try:
            return fut.result(self.timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            raise RequestError(self._timeout_message(so), "structured_outputs") from None

    async def compile_async(self, so: StructuredOutputs):
        """The same, awaited: the event loop keeps serving while the pool compiles."""
        import asyncio

        fut = asyncio.wrap_future(self.submit(so))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except asyncio.TimeoutError:
            raise RequestError(self._timeout_message(so), "structured_outputs") from None

    def _timeout_message(self, so: StructuredOutputs) -> str:
        return (
            f"structured_outputs.{so.kind} did not compile within {self.timeout:g} s; simplify it"
        )

    def _compile(self, so: StructuredOutputs):
        t0 = time.perf_counter()
        try:
            compiled = self._compile_now(so)
        except RequestError:
            raise
        except Exception as exc:  # xgrammar's parse errors are RuntimeErrors with a reason
            message = f"structured_outputs.{so.kind} could not be compiled: {_reason(exc)}"
            raise RequestError(message, "structured_outputs") from None
        logger.debug("compiled %s in %.1f ms", so.kind, (time.perf_counter() - t0) * 1e3)
        return compiled

    def _compile_now(self, so: StructuredOutputs):
        c = self._xgr
        kind = so.kind
        if kind == "json":
            return c.compile_json_schema(so.json, any_whitespace=not so.disable_any_whitespace)
        if kind == "json_object":
            schema = json.dumps({"type": "object"})
            return c.compile_json_schema(schema, any_whitespace=not so.disable_any_whitespace)
        if kind == "regex":
            return c.compile_regex(so.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(so.choice))
        import xgrammar as xgr

        grammar = so.grammar
        if "::=" not in grammar:  # Lark's syntax (rule: ...), which vLLM also takes
            grammar = xgr.Grammar.from_lark(grammar)
        return c.compile_grammar(grammar)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ log prefix ("[17:04:16] /project/cpp/x.cc:94: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """GBNF for exactly one of ``choices``, each a JSON-escaped string literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
