"""CPU-heavy request preparation off the event loop: tokenizing, chat templates, detokenizing
large outputs. One server's event loop serves every stream, so a 15 MB prompt tokenized on it
would stop them all for seconds.

The work runs on a small thread pool. The tokenizer releases the GIL while it works (its batch
calls, which Tokenizer uses), so the loop keeps running; a Jinja template holds the GIL but
Python switches threads every few milliseconds. Before any of it, a prompt whose length in
characters alone proves that it cannot fit the context is refused at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.errors import RequestError

T = TypeVar("T")

PREP_THREADS = 2  # tokenizing is fast per byte; more threads would compete with the engine


class Offloader:
    """Runs preparation functions on a bounded pool; ``await offload(fn, *args)``. Callers
    wait in asyncio (one per HTTP connection or RPC call, themselves bounded)."""

    def __init__(self, threads: int = PREP_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="prep")

    async def __call__(self, fn: Callable[..., T], *args, **kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@functools.lru_cache(maxsize=8)
def _longest_token_chars(tokenizer) -> int:
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max((len(t) for t in vocab), default=1)


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """A prompt longer than this many characters has more than ``max_model_len`` tokens: no
    token spells more characters than the vocabulary's longest entry (byte-level and
    SentencePiece vocabularies spell each text character with at least one of theirs)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        return 1 << 62  # an unknown tokenizer: no bound can be proven
    return max_model_len * _longest_token_chars(tokenizer)


def check_prompt_chars(num_chars: int, tokenizer, max_model_len: int, param: str) -> None:
    limit = max_prompt_chars(tokenizer, max_model_len)
    if num_chars > limit:
        raise RequestError(
            f"{param} is too long: {num_chars} characters cannot fit in the maximum model "
            f"length of {max_model_len} tokens (at most {limit} characters could)",
            param,
        )
