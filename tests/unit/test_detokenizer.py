"""Incremental detokenization: streamed deltas add up to the full decode, stop strings cut it."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from services.tokenizer.detokenizer import IncrementalDetokenizer, token_text

IM_END = 2  # SmolLM2's <|im_end|>, a special token

TEXTS = [
    "Hello, world! How are you?\nI'm fine; thanks.\n\n- item one\n- item two (done).",
    "你好，世界！今天天气很好。",
    "I ❤️ 🍕 and 👩‍👩‍👧",
    "café naïve",
    "def f(x):\n    if x:\n        return [x, {'a': 1}]\n\treturn None\n",
]


@pytest.fixture(scope="session")
def tok(smollm2_tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return smollm2_tokenizer


def encode(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def one_at_a_time(ids: list[int]) -> Iterator[list[int]]:
    return ([i] for i in ids)


def random_chunks(ids: list[int], rng: random.Random) -> Iterator[list[int]]:
    start = 0
    while start < len(ids):
        size = rng.randint(1, 4)
        yield ids[start : start + size]
        start += size


def cyclic_chunks(ids: list[int], sizes: Sequence[int]) -> Iterator[list[int]]:
    start = 0
    for size in itertools.cycle(sizes):
        if start >= len(ids):
            return
        yield ids[start : start + size]
        start += size


def stream(
    tok: PreTrainedTokenizerBase,
    chunks: Iterator[list[int]],
    prompt_ids: Sequence[int] = (),
    **kwargs: Any,
) -> tuple[list[str], IncrementalDetokenizer]:
    """Every delta, flush included, and the detokenizer afterwards."""
    detok = IncrementalDetokenizer(tok, list(prompt_ids), **kwargs)
    deltas = [detok.add(chunk) for chunk in chunks]
    deltas.append(detok.flush())
    return deltas, detok


def assert_exact(deltas: list[str], expected: str) -> None:
    assert "".join(deltas) == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in delta for delta in deltas)


# --- exact text, whatever the chunking ---


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tok: PreTrainedTokenizerBase, text: str) -> None:
    ids = encode(tok, text)
    deltas, detok = stream(tok, one_at_a_time(ids))
    assert_exact(deltas, tok.decode(ids))
    assert detok.text == text
    assert detok.stop_hit is None


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks_match_full_decode(
    tok: PreTrainedTokenizerBase, text: str, seed: int
) -> None:
    ids = encode(tok, text)
    deltas, _ = stream(tok, random_chunks(ids, random.Random(seed)))
    assert_exact(deltas, tok.decode(ids))


def test_split_character_is_held_until_complete(tok: PreTrainedTokenizerBase) -> None:
    ids = encode(tok, "a你")  # "你" is two byte-level tokens
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add([i]) for i in ids]
    assert deltas[-2:] == ["", "你"]
    assert detok.add([]) == ""


@pytest.mark.parametrize("text", ["ok 你", "I ❤️ 🍕", "日本語のテキスト"])
def test_a_character_cut_by_the_end_is_dropped_not_replaced(
    tok: PreTrainedTokenizerBase, text: str
) -> None:
    """max_tokens can end generation inside a multi-byte character: no U+FFFD comes out."""
    ids = encode(tok, text)
    cuts = [n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")]
    assert cuts, "the text has no token boundary inside a character"
    for n in cuts:
        for chunks in (one_at_a_time(ids[:n]), cyclic_chunks(ids[:n], [3])):
            deltas, detok = stream(tok, chunks)
            assert_exact(deltas, tok.decode(ids[:n]).rstrip("\ufffd"))
            assert "\ufffd" not in detok.text


def test_decode_window_stays_small(tok: PreTrainedTokenizerBase) -> None:
    """Each step decodes a few tokens, not the whole output."""
    longest: list[int] = [0]

    class CountingTokenizer:
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            longest[0] = max(longest[0], len(ids))
            return tok.decode(ids, **kwargs)

    ids = encode(tok, " ".join(TEXTS) * 4)
    assert len(ids) > 300
    deltas, _ = stream(CountingTokenizer(), one_at_a_time(ids), prompt_ids=ids)  # type: ignore[arg-type]
    assert "".join(deltas) == tok.decode(ids + ids)[len(tok.decode(ids)) :]
    assert longest[0] <= 12


# --- the prompt's tail as context ---


@pytest.mark.parametrize(
    ("prompt", "output"),
    [
        ("The weather is", " nice today, isn't it?"),
        ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "  Hello 世界 🍕"),
        ("一二三四五六七八九十", "你好，世界"),
        ("ends with a space ", " and starts with one"),
    ],
)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_output_after_prompt_matches_decode_of_both(
    tok: PreTrainedTokenizerBase, prompt: str, output: str, skip_special_tokens: bool
) -> None:
    prompt_ids, output_ids = encode(tok, prompt), encode(tok, output)
    deltas, _ = stream(
        tok, one_at_a_time(output_ids), prompt_ids, skip_special_tokens=skip_special_tokens
    )
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=skip_special_tokens)
    start = len(tok.decode(prompt_ids, skip_special_tokens=skip_special_tokens))
    assert_exact(deltas, full[start:])
    assert "".join(deltas).startswith(output[:2])  # leading spaces preserved


# --- stop strings ---

PARIS = "The capital is Paris. It is big. Paris! Yes, Paris."


def test_text_is_cut_before_the_stop_string(tok: PreTrainedTokenizerBase) -> None:
    deltas, detok = stream(tok, one_at_a_time(encode(tok, PARIS)), stop=["Paris!"])
    assert detok.text == "".join(deltas) == "The capital is Paris. It is big. "
    assert detok.stop_hit == "Paris!"


def test_held_text_is_released_when_it_is_not_a_stop_string(
    tok: PreTrainedTokenizerBase,
) -> None:
    ids = encode(tok, PARIS)
    num_before_dot = len(encode(tok, "The capital is Paris"))
    assert ids[:num_before_dot] == encode(tok, "The capital is Paris")
    detok = IncrementalDetokenizer(tok, [], stop=["Paris!"])
    for i in ids[:num_before_dot]:
        detok.add([i])
    assert detok.text == "The capital is "  # "Paris" may be the start of "Paris!": held
    assert detok.add([ids[num_before_dot]]) == "Paris."
    assert detok.text == "The capital is Paris."


def test_include_stop_str_in_output(tok: PreTrainedTokenizerBase) -> None:
    ids = encode(tok, PARIS)
    _, detok = stream(tok, one_at_a_time(ids), stop=["big."], include_stop_str_in_output=True)
    assert detok.text == "The capital is Paris. It is big."
    assert detok.stop_hit == "big."


def test_tokens_past_a_stop_string_in_one_step_are_not_taken(
    tok: PreTrainedTokenizerBase,
) -> None:
    """Speculative decoding returns several tokens a step: those after the one that completes
    a stop string are left out (and not counted as output)."""
    ids = encode(tok, PARIS)
    whole = IncrementalDetokenizer(tok, [], stop=["big."])
    text, num_taken = whole.add_until_stop(ids)
    assert (text, whole.stop_hit) == ("The capital is Paris. It is ", "big.")
    assert tok.decode(ids[:num_taken]).endswith("big.")
    assert not tok.decode(ids[: num_taken - 1]).endswith("big.")
    plain = IncrementalDetokenizer(tok, [])
    assert plain.add_until_stop(ids) == (plain.text, len(ids))  # no stop string: all of them


def test_earliest_stop_string_wins(tok: PreTrainedTokenizerBase) -> None:
    ids = encode(tok, PARIS)
    _, detok = stream(tok, one_at_a_time(ids), stop=["Yes", "big", "Paris!"])
    assert (detok.text, detok.stop_hit) == ("The capital is Paris. It is ", "big")


@pytest.mark.parametrize("chunk_size", [1, 2, 100])
def test_first_completed_stop_string_wins_whatever_the_chunking(
    tok: PreTrainedTokenizerBase, chunk_size: int
) -> None:
    """ "bc" completes before "abcd" does, so a streaming reader must stop there."""
    ids = encode(tok, "x abcd y")
    _, detok = stream(tok, cyclic_chunks(ids, [chunk_size]), stop=["abcd", "bc"])
    assert (detok.text, detok.stop_hit) == ("x a", "bc")


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello world, hello", "llo wor", "he"),
        ("你好，世界！今天", "世界", "你好，"),
        ("I ❤️ 🍕 and more", "🍕 a", "I ❤️ "),
    ],
)
def test_stop_string_spanning_tokens(
    tok: PreTrainedTokenizerBase, text: str, stop: str, expected: str
) -> None:
    ids = encode(tok, text)
    deltas, detok = stream(tok, one_at_a_time(ids), stop=[stop])
    assert detok.text == expected
    assert not any("\ufffd" in delta for delta in deltas)


def test_nothing_comes_after_a_stop(tok: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["."])
    assert detok.add(encode(tok, "One. Two")) == "One"
    assert detok.add(encode(tok, " three.")) == ""
    assert detok.flush() == ""
    assert (detok.text, detok.stop_hit, detok.finished) == ("One", ".", True)


def test_flush_releases_text_held_for_a_stop_string(tok: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["world"])
    assert detok.add(encode(tok, "hello wor")) == "hello "
    assert detok.flush() == "wor"
    assert detok.stop_hit is None


# --- special tokens ---


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_skip_special_tokens(tok: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
    ids = [*encode(tok, "Hi there"), IM_END, *encode(tok, " and 你好"), IM_END]
    deltas, _ = stream(tok, one_at_a_time(ids), skip_special_tokens=skip_special_tokens)
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert_exact(deltas, expected)
    assert ("<|im_end|>" in expected) is not skip_special_tokens


def test_token_text(tok: PreTrainedTokenizerBase) -> None:
    assert token_text(tok, encode(tok, " hello")[0]) == " hello"
    assert token_text(tok, IM_END) == "<|im_end|>"
    first_half = encode(tok, "你")[0]
    assert token_text(tok, first_half) == tok.convert_ids_to_tokens(first_half) != "\ufffd"


# --- properties ---

CHARS = st.one_of(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
    st.sampled_from(["\n", "é", "ï", "\u200d", "\ufe0f"]),  # newline, accents, emoji joiners
)
CHUNK_SIZES = st.lists(st.integers(1, 5), min_size=1, max_size=10)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(text=st.text(CHARS, max_size=40), sizes=CHUNK_SIZES)
def test_property_deltas_add_up_to_full_decode(
    tok: PreTrainedTokenizerBase, text: str, sizes: list[int]
) -> None:
    ids = encode(tok, text)
    deltas, _ = stream(tok, cyclic_chunks(ids, sizes))
    assert_exact(deltas, tok.decode(ids))


def cut_at_first_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The reference: the stop string that completes first (the longer one on a tie)."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found)
    return text[: end if include else start], stop


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    text=st.text(st.sampled_from("ab 你\n"), max_size=30),
    stops=st.lists(st.text(st.sampled_from("ab 你\n"), min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    sizes=CHUNK_SIZES,
)
def test_property_stop_strings_match_a_cut_of_the_full_text(
    tok: PreTrainedTokenizerBase, text: str, stops: list[str], include: bool, sizes: list[int]
) -> None:
    ids = encode(tok, text)
    deltas, detok = stream(
        tok, cyclic_chunks(ids, sizes), stop=stops, include_stop_str_in_output=include
    )
    expected = cut_at_first_stop(tok.decode(ids), stops, include)
    assert ("".join(deltas), detok.stop_hit) == expected
    assert detok.text == expected[0]
