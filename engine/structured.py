"""Constrained decoding: what a request may ask its output to match, compiled to llguidance grammars,
and the per-step token masks that keep each constrained output inside its grammar.

A ``Constraint`` is what was asked (a JSON schema, any JSON object, a regex, a choice of strings, a
Lark grammar). ``GrammarCompiler`` turns it into a ``CompiledGrammar`` against the served model's own
tokenizer, once per distinct constraint (an LRU cache; the engine serves one model, so the cache is
per model and schema): the service compiles off the step thread and off the event loop, and refuses
a constraint that does not compile, naming the problem, before anything runs. Each request then gets
a ``GrammarState`` of its own (a copy of the compiled matcher: microseconds), which the step thread
advances with every token sampled; ``constrained_logits`` sets every token the grammar forbids to -inf.

JSON is generated compact (``", "`` and ``": "`` between items, no other whitespace), so a small model
cannot spend its tokens on runs of spaces and newlines, and any output is a fixed function of the
tokens the model prefers. A JSON string that loops (``StringLoopGuard``: its last ``LOOP_NGRAM`` tokens
repeat earlier ones of the same string, verbatim) is ended there: a model caught in a loop inside a
string, where the grammar allows no end of output, would otherwise write it until ``max_tokens``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from chatmesh.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # only in the type stubs

# How JSON is written: compact, one space after ',' and ':' (what json.dumps writes), nothing else.
JSON_FORMAT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Distinct compiled constraints an engine keeps (each a few hundred KiB at most).
GRAMMAR_CACHE_SIZE = 256
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_PROBLEM_CHARS = 400  # of a refusal's message
# A JSON string that repeats this many of its own tokens verbatim is looping, and is ended (only within
# one string: keys, structure and values copied from other fields never count). Ten tokens is some
# eight words: a loop, not a figure of speech.
LOOP_NGRAM = 10
QUOTE, BACKSLASH = ord('"'), ord("\\")


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. ``spec``: the schema (JSON text), the regex, the Lark
    grammar, or the choices as a JSON list; empty for ``json_object``."""

    kind: str
    spec: str = ""

    def grammar(self) -> str:
        """llguidance's grammar of this constraint (not yet checked)."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.spec, overrides=JSON_FORMAT)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_FORMAT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in json.loads(self.spec))
            )
        return llguidance.LLMatcher.grammar_from_lark(self.spec)


class CompiledGrammar:
    """A constraint compiled against one tokenizer: a matcher at the start of the output, never
    advanced itself, that each request copies."""

    def __init__(
        self,
        constraint: Constraint,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        quotes: QuoteTable | None = None,
    ) -> None:
        self.constraint = constraint
        self.vocab_size = vocab_size  # the tokenizer's (a model's logits may be wider: padding)
        self._pristine = matcher
        self._quotes = quotes  # JSON only: what StringLoopGuard needs of the tokenizer

    def start(self, output_token_ids: Sequence[int] = ()) -> GrammarState:
        """A request's own state, advanced past ``output_token_ids`` (output resumed after a failover
        or an adoption, which this grammar produced then)."""
        matcher = self._pristine.deep_copy()
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise ValueError(f"the resumed output does not match the constraint: {matcher.get_error()}")
        loops = StringLoopGuard(self._quotes) if self._quotes is not None else None
        if loops is not None:
            for token in output_token_ids:
                loops.advance(token)
        return GrammarState(matcher, self.vocab_size, loops)


class GrammarState:
    """One request's place in its grammar (the step thread's)."""

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, loops: StringLoopGuard | None = None
    ) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.loops = loops

    def advance(self, token: int) -> None:
        # A token the mask allowed is always accepted; EOS past the end of the grammar stops it.
        self.matcher.consume_token(token)
        if self.loops is not None:
            self.loops.advance(token)


class StringLoopGuard:
    """Whether the JSON string being written is looping: its last ``LOOP_NGRAM`` tokens repeat, verbatim,
    ``LOOP_NGRAM`` earlier tokens of the same string. Follows the output byte by byte only where a token
    has a quote or a backslash (the table's ``quoting``); every other token leaves the string state as
    it was."""

    def __init__(self, table: QuoteTable) -> None:
        self._table = table
        self._in_string = False
        self._escaped = False
        self._run: list[int] = []  # the tokens wholly inside the current string
        self._seen: set[tuple[int, ...]] = set()  # its LOOP_NGRAM-grams
        self.looping = False

    def advance(self, token: int) -> None:
        text = self._table.quoting.get(token)
        if text is None:
            if self._in_string:
                self._extend(token)
            return
        was_in = self._in_string
        for byte in text:
            if self._escaped:
                self._escaped = False
            elif self._in_string and byte == BACKSLASH:
                self._escaped = True
            elif byte == QUOTE:
                self._in_string = not self._in_string
        if was_in and self._in_string:
            self._extend(token)  # an escaped quote or a backslash inside the string
        else:
            self._run.clear()
            self._seen.clear()
            self.looping = False

    def closing(self) -> np.ndarray | None:
        """The tokens that would end the string now, if it is looping (None if it is not)."""
        return self._table.closing if self.looping and not self._escaped else None

    def _extend(self, token: int) -> None:
        self._run.append(token)
        if len(self._run) >= LOOP_NGRAM:
            gram = tuple(self._run[-LOOP_NGRAM:])
            self.looping = self.looping or gram in self._seen
            self._seen.add(gram)


@dataclass(frozen=True)
class QuoteTable:
    """A tokenizer's tokens as JSON strings see them: the bytes of those with a quote or a backslash,
    and which tokens would end a string (an unescaped quote) written inside one."""

    quoting: dict[int, bytes]
    closing: np.ndarray  # bool, one per token of the vocabulary

    @classmethod
    def of(cls, tokenizer: ChatTokenizer) -> QuoteTable:
        texts = (tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size))
        quoting = {i: text for i, text in enumerate(texts) if QUOTE in text or BACKSLASH in text}
        closing = np.zeros(tokenizer.vocab_size, dtype=bool)
        for i, text in quoting.items():
            escaped = False
            for byte in text:
                if escaped:
                    escaped = False
                elif byte == BACKSLASH:
                    escaped = True
                elif byte == QUOTE:
                    closing[i] = True
                    break
        return cls(quoting, closing)


class GrammarCompiler:
    """Compiles constraints for one served tokenizer, keeping the latest ``GRAMMAR_CACHE_SIZE``.
    Thread-safe: compiles run in a pool while the step thread and the event loop go on."""

    def __init__(self, tokenizer: ChatTokenizer, cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._llg_tokenizer: llguidance.LLTokenizer | None = None  # built at the first compile (~0.5 s)
        self._quotes: QuoteTable | None = None  # built at the first JSON compile
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def cached(self, constraint: Constraint) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
            return compiled

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The compiled constraint (from the cache when there); raises ValueError saying what is wrong
        with it."""
        if (compiled := self.cached(constraint)) is not None:
            return compiled
        try:
            grammar = constraint.grammar()
        except ValueError as exc:
            raise ValueError(f"invalid {constraint.kind}: {exc}") from None
        tokenizer = self._grammar_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"unsupported or invalid {constraint.kind}: {_problem(matcher.get_error())}")
        # The first mask does the lexer's remaining lazy work here, not in some request's step.
        mask = llg_numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        llg_numpy.fill_next_token_bitmask(matcher, mask)
        if matcher.is_error():
            raise ValueError(f"unsupported or invalid {constraint.kind}: {_problem(matcher.get_error())}")
        json_output = constraint.kind in ("json_schema", "json_object")
        compiled = CompiledGrammar(
            constraint, matcher, tokenizer.vocab_size, self._quote_table() if json_output else None
        )
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _grammar_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.tokenizer_json(), eos_token=list(self._tokenizer.eos_token_ids)
                )
            return self._llg_tokenizer

    def _quote_table(self) -> QuoteTable:
        with self._lock:
            if self._quotes is None:
                self._quotes = QuoteTable.of(self._tokenizer)
            return self._quotes


def allowed_tokens(states: Sequence[GrammarState], width: int) -> np.ndarray:
    """Which tokens each state's grammar allows next: one bool row per state, ``width`` wide (a model's
    logits may be wider than its tokenizer's vocabulary: padding tokens, never allowed)."""
    vocab = states[0].vocab_size  # one served tokenizer
    bitmask = llg_numpy.allocate_token_bitmask(len(states), vocab)
    for i, state in enumerate(states):
        llg_numpy.fill_next_token_bitmask(state.matcher, bitmask, i)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").view(bool)[:, :vocab]
    for i, state in enumerate(states):
        if state.loops is not None and (closing := state.loops.closing()) is not None:
            kept = bits[i] & closing
            if kept.any():  # a string that may not end here (minLength, a pattern) goes on
                bits[i] = kept
    if width <= vocab:
        return bits[:, :width]
    wide = np.zeros((len(states), width), dtype=bool)
    wide[:, :vocab] = bits
    return wide


def constrained_logits(
    logits: np.ndarray,
    argmax: np.ndarray | None,
    rows: Sequence[int],
    states: Sequence[GrammarState],
    greedy: Sequence[bool],
) -> tuple[np.ndarray, np.ndarray | None]:
    """The step's logits and argmax (the runner's, if it has it) with ``rows`` constrained by their
    ``states``: every token a row's grammar forbids at -inf. A greedy row whose argmax its grammar
    allows is left as it is (the best allowed token is the best token: no pass over its logits). The
    runner's buffers are never written: masked rows go into a copy."""
    allowed = allowed_tokens(states, logits.shape[1])
    masked = [
        i for i, r in enumerate(rows) if not (greedy[i] and argmax is not None and allowed[i, argmax[r]])
    ]
    if not masked:
        return logits, argmax
    where = [rows[i] for i in masked]
    values = np.where(allowed[masked], logits[where], np.float32(-np.inf))
    if len(where) == len(logits):  # every row (in order: rows ascend)
        logits = values
    else:
        logits = logits.copy()
        logits[where] = values
    if argmax is not None:
        argmax = argmax.copy()
        argmax[where] = np.argmax(values, axis=1)
    return logits, argmax


def _problem(error: str) -> str:
    """llguidance's error as one line: its own words, without the source excerpt and caret lines."""
    lines = [line.strip() for line in error.strip().splitlines()]
    kept = [line for line in lines if line and line.strip("^ ") and not line.split("|")[0].strip().isdigit()]
    return " ".join(kept)[:MAX_PROBLEM_CHARS] or "the grammar was refused"
