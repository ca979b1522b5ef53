"""Structured output: a request's ``Structure`` compiled to a grammar, and the ``Guide`` that walks it.

The grammar library is llguidance: an Earley parser over a lazily built lexer, strict about JSON Schema (a keyword
it cannot enforce is an error, not ignored), with resource limits of its own (``LLParserLimits``) and a GIL-free
mask computation. A structure compiles once per ``(kind, spec)`` (``Grammars``, a bounded LRU cache of compiled
matchers in their start state, or of the error that refused it); each request walks a copy of it (``Guide``).

Bounds: a spec is at most ``MAX_SPEC_BYTES``; its compile is bounded in work by the parser limits (lexer fuel,
grammar size) and in time by ``COMPILE_DEADLINE_S`` (past it the request is refused, naming the field); a structure
that fails either way is refused again from the cache without a second compile.

A guide's masks (``cdb_engine.guide``): token ``index``'s allowed set is the grammar's after the tokens before it,
one bit per token id (bit ``i % 8`` of byte ``i // 8``), and rides the token's sampling settings
(``LogitsProcessing.allowed``) to the stage that samples. With ``forced_skip``, a token the grammar forces (its
fast-forward token: the one spelling of forced text the tokenizer would choose; the only allowed token; the end,
once the grammar is complete) is known before it is sampled: its mask is that one token, and the position that
predicts it needs no deep exit.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from cdb_engine.config import Structure, StructureKind
from cdb_engine.errors import InvalidRequest
from cdb_engine.guide import Guide, GuideWorker
from cdb_model.tokenizer import BYTE_OFFSET, SPECIAL_TOKENS, ByteTokenizer, HFTokenizer, Tokenizer

MAX_SPEC_BYTES = 64 * 1024  # a schema, regex, choice list or grammar
COMPILE_DEADLINE_S = 5.0  # a compile past it refuses the request (the parser limits end it soon after)
CACHE_SIZE = 256  # compiled structures kept (least recently used dropped first)
_MESSAGE_CHARS = 400  # of a compile error in the refusal
# JSON is generated compact: no whitespace between tokens (a schema's own "x-guidance" options may say otherwise).
JSON_OPTIONS: Any = {"whitespace_flexible": False}


def parser_limits() -> LLParserLimits:
    """The work one compile and one mask may take (llguidance's own bounds, a fifth of its defaults for the
    compile's lexer fuel: ≈ 4 ms of work at its quoted speed; errors without the grammar's text)."""
    return LLParserLimits(
        initial_lexer_fuel=200_000,
        step_lexer_fuel=200_000,
        max_grammar_size=100_000,
        verbose_errors=False,
    )


class _ByteVocabulary:
    """The byte tokenizer as llguidance reads a vocabulary: each id's bytes (special ids marked with the 0xFF
    prefix, ids past the bytes as unused specials), and an encoder."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        specials = [b"\xff" + t.encode() for t in SPECIAL_TOKENS]
        unused = [b"\xff<|unused_%d|>" % i for i in range(BYTE_OFFSET + 256, tokenizer.vocab_size)]
        self.tokens = [*specials, *(bytes([b]) for b in range(256)), *unused]
        self.special_token_ids = [*range(BYTE_OFFSET), *range(BYTE_OFFSET + 256, tokenizer.vocab_size)]
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return [b + BYTE_OFFSET for b in data]


def vocabulary(tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> LLTokenizer:
    """The model's vocabulary for llguidance: ``vocab_size`` ids (the logits' width), ending at ``stop_ids``."""
    eos = list(stop_ids) or None
    if isinstance(tokenizer, HFTokenizer):
        return LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=eos)
    if isinstance(tokenizer, ByteTokenizer):
        wrapper: Any = _ByteVocabulary(tokenizer)
        return LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
    raise TypeError(f"structured output cannot read the vocabulary of {type(tokenizer).__name__}")


def grammar_of(structure: Structure) -> str:
    """llguidance's grammar of ``structure``; ``InvalidRequest`` naming its field for a spec that is not one."""
    kind, spec, name = structure.kind, structure.spec, structure.field
    if len(spec) > MAX_SPEC_BYTES or len(spec.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise InvalidRequest(name, f"longer than {MAX_SPEC_BYTES} bytes")
    try:
        if kind == StructureKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == StructureKind.JSON:
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind == StructureKind.REGEX:
            return LLMatcher.grammar_from_regex(spec)
        if kind == StructureKind.CHOICE:
            choices = json.loads(spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise InvalidRequest(name, "must be a non-empty list of strings")
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return LLMatcher.grammar_from_lark(lark)
        if kind == StructureKind.GRAMMAR:
            return llguidance.grammar_from("grammar", spec)
    except (ValueError, TypeError) as e:  # not JSON, or a grammar that is neither Lark nor GBNF
        raise InvalidRequest(name, _short(str(e))) from None
    raise InvalidRequest(name, f"unknown structure kind {kind!r}")


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= _MESSAGE_CHARS else message[: _MESSAGE_CHARS - 3] + "..."


class Grammars:
    """Compiled structures of one model's vocabulary (an LRU cache by ``(kind, spec)``), and their guides."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int], forced_skip: bool) -> None:
        self._source = (tokenizer, vocab_size, tuple(stop_ids))
        self.forced_skip = forced_skip
        self.vocab_size = vocab_size
        self._vocab: LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="cdb-grammar")
        self._worker = GuideWorker.of_process()

    def _vocabulary(self) -> LLTokenizer:
        with self._lock:
            if self._vocab is None:
                self._vocab = vocabulary(*self._source)
            return self._vocab

    def compiled(self, structure: Structure) -> LLMatcher:
        """The structure's matcher in its start state (shared: copy it); ``InvalidRequest`` naming the field for
        one that does not compile within the limits."""
        key = (str(structure.kind), structure.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(structure)
            with self._lock:
                self._cache[key] = hit
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise InvalidRequest(structure.field, hit)
        return hit

    def _compile(self, structure: Structure) -> LLMatcher | str:
        """A compiled matcher, or the reason it was refused (cached like a matcher: no second compile)."""
        try:
            grammar = grammar_of(structure)
        except InvalidRequest as e:
            return e.message
        vocab = self._vocabulary()
        job = self._pool.submit(_build, vocab, grammar)
        try:
            return job.result(timeout=COMPILE_DEADLINE_S)
        except concurrent.futures.TimeoutError:
            return f"its grammar did not compile within {COMPILE_DEADLINE_S:g} s"

    def check(self, structure: Structure) -> None:
        """``InvalidRequest`` naming the field unless ``structure`` compiles."""
        self.compiled(structure)

    def guide(self, structure: Structure) -> Guide:
        """A fresh walk of ``structure``'s grammar for one request."""
        matcher = self.compiled(structure).deep_copy()
        return Guide(matcher, (self.vocab_size + 7) // 8, self._source[2], self.forced_skip, self._worker)


def _build(vocab: LLTokenizer, grammar: str) -> LLMatcher | str:
    error, messages = LLMatcher.validate_grammar_with_warnings(grammar, vocab, limits=parser_limits())
    if error:
        return _short(messages[0] if messages else "its grammar is not valid")
    matcher = LLMatcher(vocab, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        return _short(matcher.get_error())
    return matcher
