"""The grammar backends behind one small interface: `check` a grammar without a tokenizer (the HTTP
layer's 400), `Backend.compile` it against the served vocabulary, and a `Matcher` per request that
consumes tokens, rolls back and writes the bitmask of the tokens allowed next.

A grammar is SGLang's sampling field that carries it (`json_schema`, `regex` or `ebnf`) and its text.
llguidance is the default: one wheel with no dependencies, grammars checked without a tokenizer, and
a rollback that DSpark's verify walk needs; xgrammar (SGLang's default) is the alternative
(`--grammar-backend xgrammar`). Measured per backend: `python -m sparkrelay.tools.bench.grammar`.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from typing import Protocol

import torch

KINDS = ("json_schema", "regex", "ebnf")  # SGLang's names of the sampling fields that carry one
BACKENDS = ("llguidance", "xgrammar")


# JSON is written in one layout, `{"a": 1, "b": [2, 3]}`, not with free whitespace: a small model
# given free whitespace can fill its whole budget with newlines inside an object (seen on the bundled
# model), and the layout is what chat models print anyway. vLLM's `disable_any_whitespace`,
# xgrammar's `any_whitespace=False`.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar its backend cannot use; the message names the field and says why."""


@dataclass(frozen=True)
class Grammar:
    """What a request is constrained by: the field's name (KINDS) and its text. The compile cache's
    key."""

    kind: str
    text: str


class Matcher(Protocol):
    """One request's position in its grammar. Tokens it was never offered are refused, not
    raised."""

    def consume(self, token: int) -> bool:
        """Advance by one token; False (and the state unchanged where the backend allows) if it is
        not allowed."""

    def rollback(self, count: int) -> None:
        """Undo the last `count` consumed tokens."""

    def allows(self, tokens: list[int]) -> bool:
        """Whether the grammar takes `tokens`, in order, from the current state (left unchanged)."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask int32 [R, W]: row `row` gets the tokens allowed next, one bit each (token t is
        bit t % 32 of word t // 32)."""

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts no further token (end of sequence only)."""

    @staticmethod
    def fill_rows(entries: list[tuple["Matcher", int]], bitmask: torch.Tensor) -> None:
        """For each (matcher, row) of this backend: `fill(bitmask, row)`, all in one call."""


def version(backend: str) -> str:
    """The installed version of a backend package ('' when missing): PD peers must agree on it."""
    try:
        return importlib.metadata.version(backend)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _missing(backend: str) -> GrammarError:
    return GrammarError(
        f"--grammar-backend {backend}: the `{backend}` package is not installed "
        f"(bash scripts/setup.sh installs it; or pip install {backend})"
    )


# -- llguidance ------------------------------------------------------------------------------------
def _ll():
    try:
        import llguidance
    except ImportError:
        raise _missing("llguidance") from None
    return llguidance


def _ll_grammar(grammar: Grammar) -> str:
    """SGLang's field -> llguidance's grammar text (raises GrammarError on a malformed input)."""
    ll = _ll()
    try:
        if grammar.kind == "json_schema":
            json.loads(grammar.text)  # llguidance's own message for bad JSON names no field
            return ll.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_LAYOUT)
        if grammar.kind == "regex":
            return ll.LLMatcher.grammar_from_regex(grammar.text)
        return ll.grammar_from("ebnf", grammar.text)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"`{grammar.kind}`: {e}") from None


class _LLMatcher:
    def __init__(self, matcher) -> None:
        self._m = matcher

    def consume(self, token: int) -> bool:
        # a refused token would leave llguidance's matcher in its error state for good
        return self._m.validate_tokens([token]) == 1 and self._m.consume_token(token)

    def rollback(self, count: int) -> None:
        if count:
            self._m.rollback(count)

    def allows(self, tokens: list[int]) -> bool:
        return self._m.validate_tokens(tokens) == len(tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    @property
    def finished(self) -> bool:
        return self._m.is_stopped()

    @staticmethod
    def fill_rows(entries: list[tuple["_LLMatcher", int]], bitmask: torch.Tensor) -> None:
        # on this thread: llguidance's parallel executor stalls whenever another process holds a
        # core (docs/architecture.md, speed notes)
        for m, row in entries:
            m.fill(bitmask, row)


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        ll = _ll()
        import llguidance.hf

        self._ll = ll
        self._tok = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids) or None
        )

    @staticmethod
    def check(grammar: Grammar) -> None:
        error = _ll().LLMatcher.validate_grammar(_ll_grammar(grammar))
        if error:
            raise GrammarError(f"`{grammar.kind}`: {error.strip()}")

    def compile(self, grammar: Grammar):
        """-> a compiled grammar: a matcher at the grammar's start, copied for each request."""
        m = self._ll.LLMatcher(self._tok, _ll_grammar(grammar), log_level=0)
        if m.is_error():
            raise GrammarError(f"`{grammar.kind}`: {m.get_error()}")
        return m

    @staticmethod
    def matcher(compiled) -> Matcher:
        return _LLMatcher(compiled.deep_copy())


# -- xgrammar --------------------------------------------------------------------------------------
def _xg():
    try:
        import xgrammar
    except ImportError:
        raise _missing("xgrammar") from None
    return xgrammar


class _XGMatcher:
    def __init__(self, matcher) -> None:
        self._m = matcher

    def consume(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, count: int) -> None:
        if count:
            self._m.rollback(count)

    def allows(self, tokens: list[int]) -> bool:
        taken = 0
        while taken < len(tokens) and self._m.accept_token(tokens[taken]):
            taken += 1
        self.rollback(taken)
        return taken == len(tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def finished(self) -> bool:
        return self._m.is_terminated()

    @staticmethod
    def fill_rows(entries: list[tuple["_XGMatcher", int]], bitmask: torch.Tensor) -> None:
        for m, row in entries:
            m.fill(bitmask, row)


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        xg = _xg()
        info = xg.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids) or None
        )
        self._xg = xg
        self._compiler = xg.GrammarCompiler(info, max_threads=1)

    @staticmethod
    def check(grammar: Grammar) -> None:
        xg = _xg()
        build = {
            "json_schema": xg.Grammar.from_json_schema,
            "regex": xg.Grammar.from_regex,
            "ebnf": xg.Grammar.from_ebnf,
        }[grammar.kind]
        try:
            build(grammar.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"`{grammar.kind}`: {str(e).strip()}") from None

    def compile(self, grammar: Grammar):
        c = self._compiler
        build = {
            "json_schema": lambda text: c.compile_json_schema(
                text, any_whitespace=False, separators=(", ", ": ")
            ),
            "regex": c.compile_regex,
            "ebnf": c.compile_grammar,
        }[grammar.kind]
        try:
            return build(grammar.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"`{grammar.kind}`: {str(e).strip()}") from None

    def matcher(self, compiled) -> Matcher:
        return _XGMatcher(self._xg.GrammarMatcher(compiled))


def backend_class(name: str):
    """--grammar-backend -> its class (GrammarError when its package is missing)."""
    if name == "llguidance":
        _ll()
        return LLGuidanceBackend
    if name == "xgrammar":
        _xg()
        return XGrammarBackend
    raise GrammarError(f"--grammar-backend {name!r}: choose one of {', '.join(BACKENDS)} or none")


def check(grammar: Grammar, backend: str) -> None:
    """Raise GrammarError when `backend` cannot parse `grammar` (no tokenizer needed)."""
    if grammar.kind not in KINDS:
        raise GrammarError(f"unknown grammar field {grammar.kind!r}; one of {', '.join(KINDS)}")
    backend_class(backend).check(grammar)
