"""Structured output: a request's StructuredOutput as an llguidance grammar.

The grammar is checked once where requests come in (the tokenizer pool: `GrammarChecker`,
cached, with a deadline) and matched token by token where tokens are sampled (the executor
builds one `LLMatcher` per request from the same text). llguidance builds its lexer lazily,
so a matcher costs microseconds to make and nothing compiled has to travel between processes;
its parser limits bound the work of every step, so no schema can hang the engine.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from typing import Any

from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.gbnf_to_lark import gbnf_to_lark

from shared.protocol import ParameterError, StructuredOutput

logger = logging.getLogger(__name__)

# Whitespace a lenient JSON document may hold between its tokens: a space or two, or a line
# break and an indentation (pretty-printed JSON, 8 levels of 2 spaces). Bounded: small models
# otherwise fill the document with blank lines until max_tokens, and it never closes.
LENIENT_WHITESPACE = r"[\x20\x09]{0,2}(\x0D?\x0A[\x20\x09]{0,16})?"
# Compact JSON, the default: at most one space between tokens (after `,` and `:` as json.dumps
# writes them, or none). A small model then spends its tokens on values, not on layout.
COMPACT_WHITESPACE = r"\x20?"


def parser_limits() -> LLParserLimits:
    # Why not verbose: an error then names what the client sent, not the parser's state dump.
    return LLParserLimits(verbose_errors=False)


def grammar_of(spec: StructuredOutput) -> str:
    """The llguidance grammar (its JSON text) that `spec` asks the output to match; raises
    ParameterError naming `spec.source` for a schema that is not JSON."""
    if spec.json is not None or spec.json_object:
        schema: Any = {"type": "object"} if spec.json_object else _loads(spec.json or "", spec)
        if schema is True:
            schema = {}  # JSON Schema's `true`: any value
        if not isinstance(schema, dict):
            raise ParameterError(spec.source, "a JSON Schema must be an object")
        if not spec.lenient:
            schema = closed_objects(schema)
        options = _whitespace(spec)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ParameterError(spec.source, f"invalid JSON Schema: {exc}") from None
    if spec.regex is not None:
        return LLMatcher.grammar_from_regex(_ascii_digits(spec.regex))
    if spec.choice is not None:
        # Lark string literals take JSON's escapes, so each choice is matched byte for byte.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    assert spec.grammar is not None  # StructuredOutput.validate: exactly one kind is set
    lark = spec.grammar
    if _GBNF_RULE.search(lark):  # GBNF, as llama.cpp and xgrammar write grammars
        try:
            lark = gbnf_to_lark(lark)
        except Exception as exc:  # its parser raises several kinds for bad input
            raise ParameterError(spec.source, f"invalid GBNF grammar: {exc}") from None
    return LLMatcher.grammar_from_lark(lark)


def _whitespace(spec: StructuredOutput) -> dict[str, Any]:
    """llguidance's whitespace options: none when asked; tool arguments always compact."""
    if spec.disable_any_whitespace:
        return {"whitespace_flexible": False}
    lenient = spec.lenient and spec.source != "tools"
    return {"whitespace_pattern": LENIENT_WHITESPACE if lenient else COMPACT_WHITESPACE}


# JSON Schema keywords whose value is a subschema, a list of them, or a map of them by name.
_SUBSCHEMA = (
    *("additionalProperties", "items", "contains", "propertyNames", "not", "if", "then"),
    *("else", "unevaluatedProperties", "unevaluatedItems", "additionalItems"),
)
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists
    properties and says nothing of others (a copy; values such as `const`, `enum` and
    `default` are data, not schemas, and are left alone)."""
    if not isinstance(schema, dict):
        return schema  # `true`, `false`, or not a schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(item) for item in out[key]]
    if isinstance(out.get("items"), list):  # draft 4-7 tuples
        out["items"] = [closed_objects(item) for item in out["items"]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    listed = "properties" in out or "patternProperties" in out
    if listed and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


# A GBNF rule's head (`name ::=` at a line's start); Lark writes `name:`.
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)
# \d and \D, not escaped themselves: Rust's regex reads \d as any Unicode digit.
_DIGIT_CLASS = re.compile(r"(?<!\\)((?:\\\\)*)\\([dD])")


def _ascii_digits(regex: str) -> str:
    r"""`regex` with \d as [0-9] (and \D as [^0-9]), as Python's re.ASCII, JSON Schema's
    `pattern` and vLLM's other backends read it."""
    return _DIGIT_CLASS.sub(lambda m: m[1] + ("[0-9]" if m[2] == "d" else "[^0-9]"), regex)


def _loads(text: str, spec: StructuredOutput) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ParameterError(spec.source, f"the JSON Schema is not JSON: {exc}") from None


def llg_tokenizer(
    hf_tokenizer: Any, vocab_size: int | None = None, eos_token_ids: list[int] | None = None
) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer: every token's bytes, in a trie.

    `vocab_size`: the model's, when its lm_head has more rows than the tokenizer has tokens
    (masks are that wide; the extra ids are never allowed). Takes ~0.3-1 s: made once.
    """
    import llguidance.hf  # here: it imports transformers (half a second of a process's start)

    start = time.perf_counter()
    n_vocab = max(vocab_size or 0, len(hf_tokenizer))
    tokenizer = llguidance.hf.from_tokenizer(
        hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token_ids or None
    )
    logger.info(
        "grammar tokenizer ready: %d tokens in %.2f s", n_vocab, time.perf_counter() - start
    )
    return tokenizer


class GrammarChecker:
    """Refuses, before a request reaches the engine, a structured output whose grammar is
    invalid or takes longer than `timeout_s` to start; remembers what it decided.

    Why start a matcher and compute its first mask: that builds the lexer, which is where an
    oversized schema or regex costs time; a grammar that starts within the deadline then runs
    each step within llguidance's per-step limits.
    """

    def __init__(self, tokenizer: LLTokenizer, timeout_s: float, cache_size: int = 512) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()  # -> error, "" if valid
        self._cache_size = cache_size
        # Why threads: a check past its deadline cannot be stopped (it ends by itself within
        # the parser limits), but the request is answered at the deadline.
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self._lock = threading.Lock()

    def check(self, spec: StructuredOutput) -> None:
        """Raise ParameterError naming `spec.source` unless its grammar is valid and fast."""
        grammar = grammar_of(spec)
        key = (spec.source, grammar)
        with self._lock:
            error = self._cache.get(key)
            if error is not None:
                self._cache.move_to_end(key)
        if error is None:
            error, decided = self._check(grammar)
            if decided:
                with self._lock:
                    self._cache[key] = error
                    while len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
        if error:
            raise ParameterError(spec.source, error)

    def _check(self, grammar: str) -> tuple[str, bool]:
        """(the error, or "" if valid; whether that is the grammar's verdict to remember)."""
        future = self._pool.submit(self._start, grammar)
        try:
            return future.result(timeout=self.timeout_s), True
        except concurrent.futures.TimeoutError:
            # Not remembered: the deadline also counts the wait behind other checks, so a miss
            # may be the moment's load rather than the grammar.
            error = f"the grammar took more than {self.timeout_s:g} s to compile; simplify it"
            return error, False

    def _start(self, grammar: str) -> str:
        error = LLMatcher.validate_grammar(grammar, self.tokenizer, limits=parser_limits())
        if error:
            return f"invalid grammar: {error}"
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0, limits=parser_limits())
        matcher.compute_bitmask()
        if matcher.is_error():
            return f"invalid grammar: {matcher.get_error()}"
        return ""
