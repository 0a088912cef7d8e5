"""Compiling grammars off the engine loop: one worker thread builds the backend (its tokenizer
tables, ~0.3-1 s, at the first grammar) and compiles each distinct grammar once; the loop only
polls futures. Both backends release the GIL while they compile."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from sparkrelay.grammar.backends import Grammar, GrammarError, Matcher, backend_class

CACHE_GRAMMARS = 256  # compiled grammars kept (least recently used dropped)


class GrammarCompiler:
    def __init__(self, backend: str, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.name = backend
        self._cls = backend_class(backend)
        self._args = (tokenizer, vocab_size, tuple(eos_ids))
        self._backend = None  # built on the worker thread by the first compile
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[Grammar, Future] = OrderedDict()

    def submit(self, grammar: Grammar) -> Future:
        """The compiled grammar, as a future (shared by every request with the same grammar)."""
        fut = self._cache.get(grammar)
        if fut is not None:
            self._cache.move_to_end(grammar)
            return fut
        fut = self._pool.submit(self._compile, grammar)
        self._cache[grammar] = fut
        while len(self._cache) > CACHE_GRAMMARS:
            self._cache.popitem(last=False)
        return fut

    def _compile(self, grammar: Grammar):
        if self._backend is None:
            self._backend = self._cls(*self._args)
        return self._backend.compile(grammar)

    def matcher(self, done: Future) -> Matcher:
        """A fresh matcher at the start of a compiled grammar; raises GrammarError (a grammar the
        backend refused) or the worker's exception."""
        compiled = done.result()
        return self._backend.matcher(compiled)

    def forget_failed(self, grammar: Grammar, done: Future) -> Optional[str]:
        """Why `done` failed (dropped from the cache, so a later request compiles again), or None."""
        err = done.exception()
        if err is None:
            return None
        if self._cache.get(grammar) is done:
            del self._cache[grammar]
        if isinstance(err, GrammarError):
            return str(err)
        return f"compiling the grammar failed: {type(err).__name__}: {err}"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
