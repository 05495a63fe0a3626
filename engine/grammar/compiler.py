"""Compile grammars off the tick loop: one worker thread, a bounded cache keyed by the grammar text.

``GrammarCompiler.submit(spec)`` returns a ``concurrent.futures.Future`` at once; the worker
builds an llguidance ``LLMatcher`` for it (the expensive part: 1-1000 ms for big schemas),
and the future's result is that compiled template. Each request then gets its own copy
(``new_state``), so requests sharing a schema share one compile. A grammar that does not
compile resolves its future with ``GrammarCompileError`` naming the problem; errors are
cached too (the same text fails the same way).

JSON grammars are compiled without flexible whitespace (``whitespace_flexible: false``,
separators ``,`` and ``:``): the output is compact JSON. A small or undertrained model
left free to emit whitespace between tokens can spend its whole budget on it. A lenient spec
compiles with llguidance's ``lenient`` and ``coerce_one_of``: what it ignored is the compiled
grammar's ``approximations`` (``schema_walk.approximations``). A schema's own ``x-guidance``
object overrides these options (llguidance's rule).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import llguidance

from engine.grammar import schema_walk
from engine.grammar.spec import (KIND_CHOICE, KIND_JSON_OBJECT, KIND_JSON_SCHEMA, KIND_LARK, KIND_REGEX,
                                 GrammarSpec)

if TYPE_CHECKING:   # the matcher needs torch; the API frontend process compiles grammars without it
    from engine.grammar.matcher import GrammarState

CACHE_ENTRIES = 64
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
LENIENT_OPTIONS = {"lenient": True, "coerce_one_of": True}


class GrammarCompileError(ValueError):
    """The grammar text does not compile; the message is llguidance's, naming the problem, and
    ``keywords`` the JSON schema keywords it is about (empty when it names none)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.keywords = schema_walk.keywords_of(message)


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec`` (no validity check yet: compiling does that)."""
    if spec.kind == KIND_JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == KIND_JSON_SCHEMA:
        options = {**JSON_OPTIONS, **LENIENT_OPTIONS} if spec.lenient else JSON_OPTIONS
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=options)
        except ValueError as exc:
            raise GrammarCompileError(f"json_schema: {exc}") from None
    if spec.kind == KIND_REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == KIND_CHOICE:
        return llguidance.grammar_from("choice", spec.value)
    if spec.kind == KIND_LARK:
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    raise GrammarCompileError(f"unknown grammar kind {spec.kind!r}")


def build_ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> llguidance.LLTokenizer:
    """An llguidance tokenizer over the model's vocabulary (ids past the tokenizer's are never allowed).

    ``hf_tokenizer`` is a ``tokenizers.Tokenizer`` (what ``engine/model/tokenizer.py`` wraps).
    """
    eos = sorted(eos_ids)
    return llguidance.LLTokenizer(hf_tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos or None)


class CompiledGrammar:
    """A compiled grammar: the template matcher each request copies."""

    def __init__(self, spec: GrammarSpec, template: llguidance.LLMatcher, compile_ns: int,
                 approximations: tuple[str, ...] = ()) -> None:
        self.spec = spec
        self.template = template
        self.compile_ns = compile_ns
        self.approximations = approximations   # what a lenient compile ignored (empty when strict)


class GrammarCompiler:
    """The compile worker and its cache. Thread-safe: the tick loop and an HTTP handler may both submit."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, *, think_end_id: int | None = None,
                 max_entries: int = CACHE_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.tokenizer = ll_tokenizer
        self.vocab_size = ll_tokenizer.vocab_size
        self.think_end_id = think_end_id
        self.max_entries = max_entries
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.num_compiled = 0
        self.num_cache_hits = 0

    @classmethod
    def for_model(cls, model: Any, tokenizer: Any, vocab_size: int) -> "GrammarCompiler":
        """From the engine's model (special ids) and tokenizer wrapper (``engine.model.tokenizer``)."""
        eos = {model.eos_token_id} if getattr(model, "eos_token_id", None) is not None else set()
        return cls(build_ll_tokenizer(tokenizer.inner, vocab_size, eos),
                   think_end_id=getattr(model, "think_end_id", None))

    def submit(self, spec: GrammarSpec) -> Future:
        """The future compile of ``spec``: done at once on a cache hit (or an earlier failure)."""
        key = spec.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            self._evict()
            return future

    def compile_now(self, spec: GrammarSpec, timeout_s: float | None = None) -> CompiledGrammar:
        """Compile (or take from the cache) and wait: for callers off the tick loop (an HTTP handler)."""
        return self.submit(spec).result(timeout=timeout_s)

    def new_state(self, compiled: CompiledGrammar, spec: GrammarSpec | None = None) -> GrammarState:
        """A request's matcher. ``spec`` is the request's own (default: the compiled one): the cache
        key leaves ``after_think`` out (the matcher is the same), so a cached compile may come from
        a request that thought otherwise, and whether the grammar waits for ``</think>`` is this one's."""
        from engine.grammar.matcher import GrammarState
        spec = spec or compiled.spec
        return GrammarState(spec, compiled.template.deep_copy(), self.tokenizer,
                            start_after=self.think_end_id if spec.after_think else None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _evict(self) -> None:
        """Drop the least recently used finished entries beyond the bound (in-flight ones stay)."""
        excess = len(self._cache) - self.max_entries
        for key in [k for k, f in self._cache.items() if f.done()][:max(excess, 0)]:
            del self._cache[key]

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        start = time.monotonic_ns()
        text = grammar_text(spec)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarCompileError(f"{spec.kind} grammar does not compile: {_one_line(matcher.get_error())}")
        self.num_compiled += 1
        approximations = ()
        if spec.lenient:
            approximations = schema_walk.approximations(matcher.get_grammar_warnings())
        return CompiledGrammar(spec, matcher, time.monotonic_ns() - start, approximations)


def _one_line(message: str, limit: int = 500) -> str:
    """llguidance's multi-line message as one line (what an HTTP 400 or a log line can carry)."""
    text = " | ".join(line.strip() for line in message.strip().splitlines() if line.strip() not in ("", "^"))
    return text if len(text) <= limit else text[:limit - 3] + "..."
