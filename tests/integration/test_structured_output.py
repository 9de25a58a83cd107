"""Structured output end to end on CPU, through the offline `LLM`.

The model (tests/tool_chat_model.py) has random weights and SmolLM2's real tokenizer: its
unconstrained output is noise, so every output below that parses is the grammar's doing. Each
constrained request runs with max_tokens far above what its grammar needs, so all of them must
end with "stop" (the grammar complete, EOS the only token left), never "length".
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow import LLM, SamplingParams
from kvflow.outputs import GenerationResult
from shared.grammar import closed_objects
from shared.protocol import StructuredOutput

MAX_TOKENS = 400
PROMPTS = ["Describe the weather.", "List a few things.", "Hello", "Give me a number:"]
SEEDS = (None, 1, 2)  # None: greedy; the others: temperature 1 with that seed

SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tool_chat_model_dir: Path) -> LLM:
    return LLM(str(tool_chat_model_dir), dtype="float32", device="cpu", max_model_len=1024)


def constrained(
    spec: StructuredOutput, seed: int | None = None, max_tokens: int = MAX_TOKENS
) -> SamplingParams:
    """Greedy without a seed; sampled at temperature 1 with one."""
    return SamplingParams(
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_output=spec,
    )


def generate(llm: LLM, spec: StructuredOutput, seeds: tuple[int | None, ...] = SEEDS) -> list[str]:
    """The texts of one batch of requests under `spec`, one per seed; each must end by EOS."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(seeds))]
    results = llm.generate(prompts, [constrained(spec, seed) for seed in seeds])
    assert_stopped(results)
    return [r.text for r in results]


def assert_stopped(results: list[GenerationResult]) -> None:
    assert [r.finish_reason for r in results] == ["stop"] * len(results), [r.text for r in results]


# JSON strings, whose content may hold whitespace (escapes included).
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def assert_compact(text: str) -> None:
    """No whitespace between a JSON document's tokens (disable_any_whitespace)."""
    outside = JSON_STRING.sub("", text)
    assert not re.search(r"\s", outside), text


def assert_at_most_one_space(text: str) -> None:
    """Strict JSON's whitespace: at most one space between tokens, no line breaks."""
    outside = JSON_STRING.sub('""', text)
    assert not re.search(r"\s\s|[\t\r\n]", outside), text


# ------------------------------------------------------------------ random JSON Schemas

NAMES = "abcdefgh"
WORDS = st.text(alphabet="abcdefghij", min_size=1, max_size=6)


@st.composite
def scalar_schemas(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["string", "integer", "number", "boolean", "enum"]))
    if kind == "string":
        return {"type": "string", "maxLength": draw(st.integers(0, 12))}
    if kind == "integer":
        low = draw(st.integers(-1000, 1000))
        return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 1000))}
    if kind == "number":
        low = draw(st.integers(-100, 100))
        return {"type": "number", "minimum": low, "maximum": low + draw(st.integers(1, 100))}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"enum": draw(st.lists(WORDS, min_size=1, max_size=4, unique=True))}


@st.composite
def value_schemas(draw: st.DrawFn, nested: bool) -> dict[str, Any]:
    kind = draw(st.sampled_from(["scalar", "scalar", "array", "object"][: 4 if nested else 3]))
    if kind == "scalar":
        return draw(scalar_schemas())
    if kind == "array":
        return {
            "type": "array",
            "items": draw(scalar_schemas()),
            "maxItems": draw(st.integers(0, 3)),
        }
    return draw(object_schemas(nested=False))


@st.composite
def object_schemas(draw: st.DrawFn, nested: bool = True) -> dict[str, Any]:
    """An object of 1-5 properties, some required, that says nothing of other keys (as most
    clients write schemas: strict by default, the server allows no others); with `nested`, a
    property may be such an object itself (one level)."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    return {
        "type": "object",
        "properties": {name: draw(value_schemas(nested)) for name in names},
        "required": [name for name in names if draw(st.booleans())],
    }


# Unconstrained rows that share the batches of grammar rows below: greedy and seeded.
PLAIN_PROMPTS = ["Once upon a time", "The weather today"]
PLAIN = [
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
]


@pytest.fixture(scope="module")
def plain_alone(llm: LLM) -> list[list[int]]:
    """The unconstrained rows' tokens in a batch without any grammar row."""
    return [r.token_ids for r in llm.generate(PLAIN_PROMPTS, PLAIN)]


@pytest.mark.slow
@settings(
    derandomize=True,
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(schema=object_schemas(), compact=st.booleans())
def test_random_schemas_give_valid_json_without_touching_other_rows(
    llm: LLM, plain_alone: list[list[int]], schema: dict[str, Any], compact: bool
) -> None:
    spec = StructuredOutput(json=json.dumps(schema), disable_any_whitespace=compact)
    # Grammar rows and plain rows interleaved: [json, plain, json, plain, json].
    prompts = [PROMPTS[0], PLAIN_PROMPTS[0], PROMPTS[1], PLAIN_PROMPTS[1], PROMPTS[2]]
    params = [constrained(spec, 1), PLAIN[0], constrained(spec, 2), PLAIN[1], constrained(spec, 3)]
    results = llm.generate(prompts, params)
    assert_stopped(results[0::2])
    for result in results[0::2]:
        # Only the listed keys, at every level: the schema closed, as the server reads it.
        jsonschema.validate(json.loads(result.text), closed_objects(schema))
        if compact:
            assert_compact(result.text)
        else:
            assert_at_most_one_space(result.text)
    assert [results[1].token_ids, results[3].token_ids] == plain_alone


# ------------------------------------------------------------------ regex and choice

REGEXES = [
    r"\(\d{3}\) \d{3}-\d{4}",  # a phone number
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",  # a date
    r"[a-z]{1,8}(\.[a-z]{1,8})?@[a-z]{2,8}\.(com|org|net)",  # an email address, roughly
    r"(yes|no|maybe)( please)?",  # alternatives, then an optional tail
    r"(café|naïve|日本) ?[0-9]{1,3}",  # non-ASCII
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_match_in_full(llm: LLM, pattern: str) -> None:
    for text in generate(llm, StructuredOutput(regex=pattern)):
        assert re.fullmatch(pattern, text), text


# Each needs escaping in a grammar literal; "plain" is a prefix of "plain text".
CHOICES = ['say "hi"', "back\\slash", "two\nlines", "café ☕", "日本語", "plain", "plain text"]


def test_choice_outputs_are_one_of_the_choices(llm: LLM) -> None:
    texts = generate(llm, StructuredOutput(choice=CHOICES), seeds=(None, 1, 2, 3, 4, 5))
    assert set(texts) <= set(CHOICES), texts


# ------------------------------------------------------------------ grammars

# One small arithmetic language, nested through parentheses, in both grammar notations.
LARK_ARITHMETIC = r"""
start: expr
expr: term (OP term)?
term: NUMBER | "(" expr ")"
OP: "+" | "-" | "*" | "/"
NUMBER: /[0-9]{1,3}/
"""
GBNF_ARITHMETIC = r"""
root ::= expr
expr ::= term (op term)?
term ::= number | "(" expr ")"
op ::= "+" | "-" | "*" | "/"
number ::= [0-9] [0-9]? [0-9]?
"""
NUMBER = re.compile(r"[0-9]{1,3}")


def is_arithmetic(text: str) -> bool:
    """Whether `text` is in the language above (recursive descent; it is LL(1))."""

    def expr(i: int | None) -> int | None:
        i = term(i)
        if i is not None and i < len(text) and text[i] in "+-*/":
            return term(i + 1)
        return i

    def term(i: int | None) -> int | None:
        if i is None:
            return None
        if text.startswith("(", i):
            end = expr(i + 1)
            return end + 1 if end is not None and text.startswith(")", end) else None
        number = NUMBER.match(text, i)
        return None if number is None else number.end()

    return expr(0) == len(text)


def test_the_arithmetic_checker_reads_its_language() -> None:
    for text in ["7", "12+345", "(1*(2-3))/40", "((5))"]:
        assert is_arithmetic(text), text
    for text in ["", "1234", "1+2+3", "(1", "1)", "+1", "1 + 2", "()"]:
        assert not is_arithmetic(text), text


@pytest.mark.parametrize("grammar", [LARK_ARITHMETIC, GBNF_ARITHMETIC], ids=["lark", "gbnf"])
def test_grammar_outputs_parse(llm: LLM, grammar: str) -> None:
    for text in generate(llm, StructuredOutput(grammar=grammar), seeds=(None, 1, 2, 3, 4, 5)):
        assert is_arithmetic(text), text


# ------------------------------------------------------------------ JSON without a schema


@pytest.mark.parametrize("compact", [False, True], ids=["whitespace", "compact"])
def test_json_object_outputs_are_objects(llm: LLM, compact: bool) -> None:
    """Any object: its strings have no length bound, and a random model seldom closes one (the
    quote is one allowed token among thousands), so only outputs that end are read; the greedy
    ones here end ("{}")."""
    spec = StructuredOutput(json_object=True, disable_any_whitespace=compact)
    results = llm.generate(PROMPTS[:3], [constrained(spec, seed, max_tokens=60) for seed in SEEDS])
    ended = [r.text for r in results if r.finish_reason == "stop"]
    assert ended
    for text in ended:
        assert isinstance(json.loads(text), dict), text
        if compact:
            assert_compact(text)


def test_disable_any_whitespace_leaves_none_outside_strings(llm: LLM) -> None:
    spec = StructuredOutput(json=json.dumps(SMALL_SCHEMA), disable_any_whitespace=True)
    for text in generate(llm, spec):
        jsonschema.validate(json.loads(text), SMALL_SCHEMA)
        assert_compact(text)


# ------------------------------------------------------------------ batches and preemption


def test_a_seeded_constrained_request_is_the_same_alone_and_in_a_batch(llm: LLM) -> None:
    spec = StructuredOutput(json=json.dumps(SMALL_SCHEMA))
    [alone] = llm.generate(PROMPTS[:1], constrained(spec, seed=42))
    neighbours = [
        constrained(StructuredOutput(regex=REGEXES[0]), seed=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20),
        constrained(StructuredOutput(choice=CHOICES), seed=4),
    ]
    batched = llm.generate(PROMPTS, [constrained(spec, seed=42), *neighbours])
    assert batched[0].token_ids == alone.token_ids
    assert alone.finish_reason == "stop"


# Long outputs: four strings of 10 to 12 characters, a few tokens each.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "minLength": 10, "maxLength": 12},
            "minItems": 4,
            "maxItems": 4,
        },
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["words", "size"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_preempted_requests_resume_where_their_grammar_was(
    llm: LLM, tool_chat_model_dir: Path
) -> None:
    """Eight requests of some 40-80 tokens each in a pool of 12 blocks (192 tokens): requests
    are preempted and recomputed, and a resumed request's matcher replays its output so far.
    Their tokens are then those they get with room to spare."""
    small = LLM(
        str(tool_chat_model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=192,
        num_gpu_blocks_override=12,
        block_size=16,
    )
    spec = StructuredOutput(json=json.dumps(LONG_SCHEMA))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [constrained(spec, seed, max_tokens=160) for seed in (None, *range(1, 8))]
    results = small.generate(prompts, params)
    assert small.stats().num_preemptions > 0
    assert_stopped(results)
    for result in results:
        jsonschema.validate(json.loads(result.text), LONG_SCHEMA)
    roomy = llm.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
