"""Structured output's pieces on their own: the grammar each StructuredOutput becomes, the
checks that refuse bad ones (naming the request field), the bitmask's bit layout, its use in
the sampler, and the executor's matchers against llguidance's own answers."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import threading
import tracemalloc
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher, LLTokenizer

from services.executor.runner.grammar import GrammarMatchers, eos_only_row, pack_bits
from services.executor.runner.sampler import Sampler, SamplingRow, apply_token_bitmask, unpack_bits
from shared.grammar import (
    GrammarChecker,
    closed_objects,
    grammar_of,
    llg_tokenizer,
    parser_limits,
)
from shared.protocol import ParameterError, SamplingParams, StructuredOutput
from tests.integration.test_structured_output import GBNF_ARITHMETIC, LARK_ARITHMETIC

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer) -> LLTokenizer:
    return llg_tokenizer(smollm2_tokenizer)


@pytest.fixture(scope="module")
def checker(tokenizer: LLTokenizer) -> GrammarChecker:
    return GrammarChecker(tokenizer, timeout_s=10.0)


def accepts(tokenizer: LLTokenizer, spec: StructuredOutput, text: str) -> bool:
    """Whether `spec`'s grammar matches `text` in full."""
    matcher = LLMatcher(tokenizer, grammar_of(spec), log_level=0, limits=parser_limits())
    token_ids = tokenizer.tokenize_str(text)
    if matcher.validate_tokens(token_ids) != len(token_ids):
        return False
    assert matcher.consume_tokens(token_ids)
    return matcher.is_accepting()


def schema_spec(schema: dict[str, Any], **fields: Any) -> StructuredOutput:
    return StructuredOutput(json=json.dumps(schema), **fields)


OK_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------ grammar_of


def test_a_json_schema_matches_its_documents(tokenizer: LLTokenizer) -> None:
    spec = schema_spec(OK_SCHEMA)
    assert accepts(tokenizer, spec, '{"ok": true}')
    assert accepts(tokenizer, spec, '{"ok":false}')
    assert not accepts(tokenizer, spec, '{"ok": 1}')
    assert not accepts(tokenizer, spec, '{"ok": true, "more": 1}')  # additionalProperties
    assert not accepts(tokenizer, spec, "{}")  # required


def test_json_whitespace_is_compact_bounded_or_off(tokenizer: LLTokenizer) -> None:
    spec = schema_spec(OK_SCHEMA)  # strict: at most one space between tokens
    assert accepts(tokenizer, spec, '{"ok": true}')
    assert accepts(tokenizer, spec, '{ "ok" : true }')
    assert not accepts(tokenizer, spec, '{"ok":  true}')
    assert not accepts(tokenizer, spec, '{\n  "ok": true\n}')
    lenient = schema_spec(OK_SCHEMA, lenient=True)  # pretty-printing, bounded
    assert accepts(tokenizer, lenient, '{\n  "ok":\n true}')
    assert not accepts(tokenizer, lenient, "{" + " " * 100 + '"ok":true}')
    tools = schema_spec(OK_SCHEMA, lenient=True, source="tools")  # arguments: always compact
    assert not accepts(tokenizer, tools, '{\n  "ok": true\n}')
    compact = schema_spec(OK_SCHEMA, disable_any_whitespace=True)
    assert accepts(tokenizer, compact, '{"ok":true}')
    assert not accepts(tokenizer, compact, '{"ok": true}')
    assert not accepts(tokenizer, compact, '{"ok":true}\n')


OPEN_SCHEMA = {  # as most clients send tool parameters: nothing said of other keys
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


def test_objects_take_only_their_listed_properties_unless_lenient_or_told(
    tokenizer: LLTokenizer,
) -> None:
    assert accepts(tokenizer, schema_spec(OPEN_SCHEMA), '{"a": 3, "b": 9}')
    assert not accepts(tokenizer, schema_spec(OPEN_SCHEMA), '{"a": 3, "b": 9, "c": 1}')
    assert accepts(tokenizer, schema_spec(OPEN_SCHEMA, lenient=True), '{"a": 3, "b": 9, "c": 1}')
    told = {**OPEN_SCHEMA, "additionalProperties": True}
    assert accepts(tokenizer, schema_spec(told), '{"a": 3, "b": 9, "c": 1}')
    typed = {**OPEN_SCHEMA, "additionalProperties": {"type": "string"}}
    assert accepts(tokenizer, schema_spec(typed), '{"a": 3, "b": 9, "c": "x"}')
    assert not accepts(tokenizer, schema_spec(typed), '{"a": 3, "b": 9, "c": 1}')


def test_closed_objects_closes_every_object_schema_and_no_data() -> None:
    inner = {"type": "object", "properties": {"x": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "properties": inner,  # a property named like the keyword
            "list": {"type": "array", "items": inner},
            "either": {"anyOf": [inner, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/thing"},
            "open": {**inner, "additionalProperties": True},
        },
        "$defs": {"thing": inner},
        "default": {"properties": {"y": 1}},  # data: left alone
        "enum": [{"properties": {}}],
    }
    closed = closed_objects(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["thing"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert closed["default"] == {"properties": {"y": 1}} and closed["enum"] == schema["enum"]
    assert "additionalProperties" not in inner  # a copy: the input is unchanged
    assert closed_objects({"type": "object"}) == {"type": "object"}  # no properties: any keys


def test_json_object_matches_any_object_and_nothing_else(tokenizer: LLTokenizer) -> None:
    spec = StructuredOutput(json_object=True)
    assert accepts(tokenizer, spec, '{"a": [1, "x", {"b": null}]}')
    assert accepts(tokenizer, spec, "{}")
    for text in ["[1]", '"x"', "3", "{"]:
        assert not accepts(tokenizer, spec, text), text


def test_a_regex_matches_in_full(tokenizer: LLTokenizer) -> None:
    spec = StructuredOutput(regex=r"[0-9]{4}-(0[1-9]|1[0-2])-[0-9]{2}")
    assert accepts(tokenizer, spec, "2024-12-31")
    assert not accepts(tokenizer, spec, "2024-13-31")
    assert not accepts(tokenizer, spec, "2024-12-31 ")
    assert not accepts(tokenizer, spec, "2024-12")


def test_a_regex_digit_is_an_ascii_digit(tokenizer: LLTokenizer) -> None:
    assert accepts(tokenizer, schema_spec({"type": "string", "pattern": r"^\d{3}$"}), '"123"')
    assert not accepts(tokenizer, schema_spec({"type": "string", "pattern": r"^\d{3}$"}), '"٣٣٣"')
    assert accepts(tokenizer, StructuredOutput(regex=r"\d{3}"), "123")
    assert not accepts(tokenizer, StructuredOutput(regex=r"\d{3}"), "٣٣٣")  # Arabic-Indic 3s


CHOICES = ['say "hi"', "back\\slash", "two\nlines", "café ☕", "plain", "plain text"]


def test_choices_match_byte_for_byte(tokenizer: LLTokenizer) -> None:
    spec = StructuredOutput(choice=CHOICES)
    for choice in CHOICES:
        assert accepts(tokenizer, spec, choice), choice
    for near_miss in ['say \\"hi\\"', "back\\\\slash", "two\\nlines", "cafe ☕", "plain ", "say"]:
        assert not accepts(tokenizer, spec, near_miss), near_miss


@pytest.mark.parametrize("grammar", [LARK_ARITHMETIC, GBNF_ARITHMETIC], ids=["lark", "gbnf"])
def test_lark_and_gbnf_grammars_match_their_language(tokenizer: LLTokenizer, grammar: str) -> None:
    spec = StructuredOutput(grammar=grammar)
    for text in ["7", "12+345", "(1*(2-3))/40"]:
        assert accepts(tokenizer, spec, text), text
    for text in ["1234", "1+2+3", "(1", "1 + 2", "()"]:
        assert not accepts(tokenizer, spec, text), text


def test_a_lark_grammar_may_hold_the_gbnf_arrow_in_a_literal(tokenizer: LLTokenizer) -> None:
    spec = StructuredOutput(grammar='start: "x ::= " NAME\nNAME: /[a-z]+/')
    assert accepts(tokenizer, spec, "x ::= y")


def test_the_true_schema_matches_any_json(tokenizer: LLTokenizer) -> None:
    spec = StructuredOutput(json="true")
    assert accepts(tokenizer, spec, '[1, {"a": "b"}]')


# ------------------------------------------------------------------ refusals

BAD_SPECS = [
    (StructuredOutput(json="{not json", source="response_format"), "is not JSON"),
    (StructuredOutput(json="[1, 2]", source="guided_json"), "must be an object"),
    (StructuredOutput(json='"string"', source="structured_outputs"), "must be an object"),
    (StructuredOutput(json='{"type": "strin"}', source="tool_choice"), "strin"),
    (StructuredOutput(regex="(ab", source="guided_regex"), "unclosed group"),
    (StructuredOutput(grammar="start: foo", source="guided_grammar"), "foo"),
    (StructuredOutput(grammar="start: (", source="structured_outputs"), "invalid grammar"),
    (StructuredOutput(grammar="root ::= (", source="guided_grammar"), "invalid GBNF"),
    (StructuredOutput(grammar="root ::= foo", source="guided_grammar"), "foo"),
]


@pytest.mark.parametrize("spec, message", BAD_SPECS)
def test_invalid_grammars_are_the_clients_error_naming_the_field(
    checker: GrammarChecker, spec: StructuredOutput, message: str
) -> None:
    with pytest.raises(ParameterError, match=message) as error:
        checker.check(spec)
    assert error.value.param == spec.source


def count_checks(checker: GrammarChecker, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The grammars `checker` actually compiles from now on (not answered from its cache)."""
    compiled: list[str] = []
    check = checker._check

    def counting(grammar: str) -> Any:
        compiled.append(grammar)
        return check(grammar)

    monkeypatch.setattr(checker, "_check", counting)
    return compiled


def test_decisions_are_remembered(tokenizer: LLTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    checker = GrammarChecker(tokenizer, timeout_s=10.0)
    compiled = count_checks(checker, monkeypatch)
    good, bad = StructuredOutput(regex="[a-z]+"), StructuredOutput(regex="(ab")
    checker.check(good)
    checker.check(good)
    for _ in range(2):
        with pytest.raises(ParameterError):
            checker.check(bad)
    assert len(compiled) == 2
    # The error names the field, so the same grammar from another field is checked again.
    with pytest.raises(ParameterError) as error:
        checker.check(StructuredOutput(regex="(ab", source="guided_regex"))
    assert error.value.param == "guided_regex" and len(compiled) == 3


def test_the_cache_forgets_the_least_recently_used(
    tokenizer: LLTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = GrammarChecker(tokenizer, timeout_s=10.0, cache_size=2)
    compiled = count_checks(checker, monkeypatch)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    for spec in (a, b, a, c):  # c evicts b, used less recently than a
        checker.check(spec)
    assert len(compiled) == 3
    checker.check(a)
    assert len(compiled) == 3
    checker.check(b)
    assert len(compiled) == 4


# An object of 2,000 optional properties: its first mask takes some 0.4 s to compute, far
# past the deadline below however the threads are scheduled.
LARGE_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "integer"} for i in range(2000)},
}


def test_a_grammar_past_the_deadline_is_refused(tokenizer: LLTokenizer) -> None:
    checker = GrammarChecker(tokenizer, timeout_s=1e-6)
    with pytest.raises(ParameterError, match="took more than") as error:
        checker.check(schema_spec(LARGE_SCHEMA, source="response_format"))
    assert error.value.param == "response_format"


def test_a_check_that_waited_behind_others_is_not_held_against_its_grammar(
    tokenizer: LLTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline counts the wait for one of the checker's two threads: a grammar refused
    while both were busy is checked again later, not refused for good."""
    checker = GrammarChecker(tokenizer, timeout_s=0.2)
    release = threading.Event()
    start = checker._start

    def start_slowly_for_slow(grammar: str) -> str:
        if "slow" in grammar:
            release.wait(10.0)
        return start(grammar)

    monkeypatch.setattr(checker, "_start", start_slowly_for_slow)
    for name in ("slow1", "slow2"):  # both of the pool's threads are now busy
        with pytest.raises(ParameterError, match="took more than"):
            checker.check(StructuredOutput(regex=name))
    quick = StructuredOutput(regex="[a-z]+")
    with contextlib.suppress(ParameterError):  # refused or not while it waits for a thread
        checker.check(quick)
    release.set()
    checker._pool.submit(lambda: None).result()  # the pool has caught up
    checker.check(quick)  # the grammar itself is fine


# ------------------------------------------------------------------ the bitmask's bits


@st.composite
def bool_masks(draw: st.DrawFn) -> torch.Tensor:
    num_rows, num_tokens = draw(st.integers(1, 4)), 32 * draw(st.integers(1, 5))
    bits = draw(
        st.lists(st.booleans(), min_size=num_rows * num_tokens, max_size=num_rows * num_tokens)
    )
    return torch.tensor(bits).view(num_rows, num_tokens)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(bool_masks())
def test_pack_then_unpack_gives_the_mask_back(allowed: torch.Tensor) -> None:
    words = pack_bits(allowed)
    assert words.dtype == torch.int32 and words.shape == (allowed.shape[0], allowed.shape[1] // 32)
    assert torch.equal(unpack_bits(words), allowed)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=8))
def test_unpack_then_pack_gives_the_words_back(values: list[int]) -> None:
    words = torch.tensor([values], dtype=torch.int32)
    assert torch.equal(pack_bits(unpack_bits(words)), words)


def test_bit_j_of_word_w_is_token_32w_plus_j() -> None:
    words = torch.tensor([[1 << 3, -(2**31)]], dtype=torch.int32)  # bits 3 and 63
    assert unpack_bits(words)[0].nonzero().flatten().tolist() == [3, 63]


def test_an_eos_only_row_allows_the_eos_tokens_alone() -> None:
    row = eos_only_row([2, 40, 95], width=3)
    assert row.shape == (3,) and row.dtype == torch.int32
    assert unpack_bits(row[None])[0].nonzero().flatten().tolist() == [2, 40, 95]


# ------------------------------------------------------------------ the mask in the sampler


def random_mask(num_rows: int, num_tokens: int, seed: int) -> torch.Tensor:
    """[num_rows, num_tokens] bool, about half allowed, at least one token per row."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(num_rows, num_tokens, generator=generator) < 0.5
    allowed[:, seed % num_tokens] = True
    return allowed


@pytest.mark.parametrize("vocab", [64, 80, 50], ids=["as-wide", "padded-vocab", "narrower"])
def test_apply_token_bitmask_masks_exactly_the_disallowed_tokens_of_its_rows(vocab: int) -> None:
    """The mask covers 64 tokens: logits as wide, wider (a padded lm_head: the extra columns
    are never allowed), or narrower (the mask's tail is ignored)."""
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))  # [R, V]
    rows = torch.tensor([3, 0])
    allowed = random_mask(2, 64, seed=1)  # [G, 64]
    masked = logits.clone()
    apply_token_bitmask(masked, rows, pack_bits(allowed))
    expected = logits.clone()
    for g, row in enumerate(rows.tolist()):
        for token in range(vocab):
            if token >= 64 or not allowed[g, token]:
                expected[row, token] = float("-inf")
    assert torch.equal(masked, expected)  # rows 1, 2, 4 untouched


def constrained_row(**params: Any) -> SamplingRow:
    # The sampler reads only whether a row has a structured output; the mask says the rest.
    spec = StructuredOutput(regex="x")
    return SamplingRow(SamplingParams(structured_output=spec, **params), [1, 2], [])


def test_sampling_never_picks_a_disallowed_token() -> None:
    vocab, num_each = 64, 300
    allowed = random_mask(2, vocab, seed=3)  # two grammars' masks
    rows = [constrained_row(temperature=1.0) for _ in range(2 * num_each)]
    rows += [SamplingRow(SamplingParams(temperature=1.0), [1, 2], []) for _ in range(num_each)]
    # Constrained rows 0..599 alternate between the two masks; rows 600.. have none.
    mask_rows = torch.arange(2 * num_each)
    bitmask = pack_bits(allowed[mask_rows % 2])
    for seed in range(3):
        logits = 3.0 * torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))
        token_ids = Sampler(vocab, (63,), CPU, seed)(logits, rows, (mask_rows, bitmask)).token_ids
        for row, token in enumerate(token_ids[: 2 * num_each]):
            assert allowed[row % 2, token], (row, token)
        free = token_ids[2 * num_each :]
        assert any(not allowed[0, t] and not allowed[1, t] for t in free)  # no mask leaked


def test_greedy_picks_the_best_allowed_token() -> None:
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    allowed = random_mask(2, vocab, seed=5)
    rows = [
        constrained_row(temperature=0.0),
        SamplingRow(SamplingParams(temperature=0.0), [1], []),
        constrained_row(temperature=0.0, seed=9),
    ]
    mask_rows = torch.tensor([0, 2])
    token_ids = Sampler(vocab, (63,), CPU)(logits, rows, (mask_rows, pack_bits(allowed))).token_ids
    best_allowed = logits[[0, 2]].masked_fill(~allowed, float("-inf")).argmax(dim=-1).tolist()
    assert token_ids == [best_allowed[0], int(logits[1].argmax()), best_allowed[1]]


# ------------------------------------------------------------------ the executor's matchers


@pytest.fixture(scope="module")
def matchers(smollm2_tokenizer) -> GrammarMatchers:
    return GrammarMatchers(
        lambda: smollm2_tokenizer, len(smollm2_tokenizer), [smollm2_tokenizer.eos_token_id]
    )


def mask_of(matcher: LLMatcher) -> set[int]:
    """The tokens llguidance's own bitmask allows next (bytes, bit t of byte t // 8)."""
    bits = matcher.compute_bitmask()
    return {t for t in range(8 * len(bits)) if bits[t // 8] >> (t % 8) & 1}


def accepted_one_by_one(matcher: LLMatcher, token_ids: set[int]) -> bool:
    return all(matcher.validate_tokens([t]) == 1 for t in token_ids)


def allowed_in(bitmask: torch.Tensor) -> list[set[int]]:
    return [set(row.nonzero().flatten().tolist()) for row in unpack_bits(bitmask)]


def test_the_bitmask_allows_what_llguidance_allows(
    matchers: GrammarMatchers, smollm2_tokenizer
) -> None:
    spec = schema_spec(OK_SCHEMA)
    vocab = len(smollm2_tokenizer)
    fresh = matchers.matcher(spec, [])
    midway = matchers.matcher(spec, [])
    assert midway.consume_tokens(matchers.tokenizer.tokenize_str('{"ok": tr'))
    bitmask = matchers.bitmask([fresh, midway], CPU)
    assert bitmask.shape == (2, vocab // 32) and bitmask.dtype == torch.int32
    rows = allowed_in(bitmask)
    assert rows == [mask_of(fresh), mask_of(midway)]
    for row, matcher in zip(rows, [fresh, midway], strict=True):
        assert row and accepted_one_by_one(matcher, row)
    assert {smollm2_tokenizer.decode([t]) for t in rows[0]} <= {"{", '{"'}
    assert all("ue".startswith(smollm2_tokenizer.decode([t])) for t in rows[1])


def test_a_finished_or_failed_matcher_allows_only_eos(
    matchers: GrammarMatchers, smollm2_tokenizer
) -> None:
    spec, eos = schema_spec(OK_SCHEMA), smollm2_tokenizer.eos_token_id
    done = matchers.matcher(spec, [])
    assert done.consume_tokens(matchers.tokenizer.tokenize_str('{"ok": true}'))
    failed = matchers.matcher(spec, [])
    failed.consume_token(matchers.tokenizer.tokenize_str("x")[0])  # refused: no "{" first
    assert failed.is_error()
    healthy = matchers.matcher(spec, [])
    rows = allowed_in(matchers.bitmask([done, failed, healthy], CPU))
    assert rows == [{eos}, {eos}, mask_of(healthy)]


def test_a_resumed_request_replays_its_output(
    matchers: GrammarMatchers, caplog: pytest.LogCaptureFixture
) -> None:
    spec = schema_spec(OK_SCHEMA)
    output_ids = matchers.tokenizer.tokenize_str('{"ok": fa')
    by_hand = matchers.matcher(spec, [])
    assert by_hand.consume_tokens(output_ids)
    resumed = matchers.matcher(spec, output_ids)
    assert torch.equal(*matchers.bitmask([by_hand, resumed], CPU))
    with caplog.at_level(logging.WARNING):
        matchers.matcher(spec, matchers.tokenizer.tokenize_str("nope"))
    assert "does not match its grammar" in caplog.text


def test_the_executor_holds_nothing_per_schema(matchers: GrammarMatchers) -> None:
    """A server's executor meets a new schema with every other request: what it keeps for
    them must not grow with their number (a bounded cache would be fine)."""

    def retained_after_new_specs(round: int) -> int:
        for i in range(600):  # ~4 KB of grammar text each
            spec = StructuredOutput(regex=f"{round}-{i}:" + "[a-z]" * 800)
            matchers.matcher(spec, [])
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    tracemalloc.start()
    try:
        first = retained_after_new_specs(0)
        growth = retained_after_new_specs(1) - first
    finally:
        tracemalloc.stop()
    assert growth < 600 * 4000 // 10, growth


def test_a_padded_vocab_widens_the_mask_but_never_allows_the_padding(smollm2_tokenizer) -> None:
    vocab = len(smollm2_tokenizer)
    padded = GrammarMatchers(lambda: smollm2_tokenizer, vocab + 64, [2])
    [row] = allowed_in(
        padded.bitmask([padded.matcher(StructuredOutput(json_object=True), [])], CPU)
    )
    assert padded.width == (vocab + 64) // 32
    assert row and max(row) < vocab


def test_structured_output_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="needs a tokenizer"):
        _ = GrammarMatchers(lambda: None, 64, [2]).tokenizer
