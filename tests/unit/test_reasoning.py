"""Reading a reasoning model's thinking apart from its answer: the two parsers on whole
outputs, and the streamed reading, which adds up to the whole one however the text is cut."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.tokenizer.reasoning import (
    ReasoningReader,
    ReasoningSplit,
    parse,
    starts_in_reasoning,
)

QWEN3_THINKING = "<think>\nLet me add.\n</think>\n\nIt is 4."
R1 = "Okay, 2+2.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize(
    ("text", "in_reasoning", "expected"),
    [
        # qwen3 with thinking on: the model opens <think> itself
        (QWEN3_THINKING, False, ReasoningSplit("\nLet me add.\n", "It is 4.")),
        # qwen3 with thinking off: no tags, all answer
        ("It is 4.", False, ReasoningSplit("", "It is 4.")),
        # ... even if a </think> shows up later in the answer (it was not thinking)
        ("a </think> b", False, ReasoningSplit("", "a </think> b")),
        # deepseek_r1 (and qwen3 whose prompt opened <think>): the output starts thinking
        (R1, True, ReasoningSplit("Okay, 2+2.\n", "The answer is 4.")),
        ("<think>x</think>y", True, ReasoningSplit("x", "y")),  # an R1-Distill's own <think>
        # cut by max_tokens before </think>: all thinking
        ("<think>still thinking", False, ReasoningSplit("still thinking", "")),
        ("still thinking", True, ReasoningSplit("still thinking", "")),
        # only newlines right after </think> go; the answer's own spacing stays
        ("a</think>\n\n b\n", True, ReasoningSplit("a", " b\n")),
        ("a</think>\n\n", True, ReasoningSplit("a", "")),
        ("", True, ReasoningSplit()),
        ("", False, ReasoningSplit()),
        # a <think> not at the start is text
        ("x<think>y", False, ReasoningSplit("", "x<think>y")),
        ("r</think>c</think>d", True, ReasoningSplit("r", "c</think>d")),
    ],
)
def test_parse(text: str, in_reasoning: bool, expected: ReasoningSplit) -> None:
    assert parse(text, in_reasoning) == expected
    assert stream(text, [], in_reasoning) == expected


def test_where_an_output_starts() -> None:
    assert starts_in_reasoning("deepseek_r1", "<|Assistant|>")
    assert starts_in_reasoning("deepseek_r1", "<|Assistant|><think>\n")
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n")
    # Qwen3 with enable_thinking false wrote an empty, closed block into the prompt
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Qwen3 thinking-only models: the template opened it
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        starts_in_reasoning("granite", "")


def stream(text: str, cuts: list[int], in_reasoning: bool) -> ReasoningSplit:
    reader = ReasoningReader(in_reasoning)
    out = ReasoningSplit()
    bounds = [0, *sorted(cuts), len(text)]
    for start, end in itertools.pairwise(bounds):
        out += reader.feed(text[start:end])
    return out + reader.finish()


def test_a_tag_split_over_pieces_is_still_read() -> None:
    reader = ReasoningReader(in_reasoning=False)
    pieces = ["<th", "ink>ab", "c</th", "ink", ">\n", "\nan", "swer"]
    outs = [reader.feed(p) for p in pieces]
    assert outs == [
        ReasoningSplit(),  # might be <think>: held
        ReasoningSplit("ab"),
        ReasoningSplit("c"),  # "</th" held
        ReasoningSplit(),
        ReasoningSplit(),  # the newline after </think> is dropped
        ReasoningSplit(content="an"),
        ReasoningSplit(content="swer"),
    ]
    assert sum(outs, ReasoningSplit()) + reader.finish() == ReasoningSplit("abc", "answer")


def test_thinking_streams_as_it_is_written() -> None:
    """Nothing is held for long: only what may still be a tag."""
    reader = ReasoningReader(in_reasoning=True)
    assert reader.feed("Let me think <") == ReasoningSplit("Let me think ")
    assert reader.feed("b> about it") == ReasoningSplit("<b> about it")
    reader = ReasoningReader(in_reasoning=False)
    assert reader.feed("Hello") == ReasoningSplit(content="Hello")  # thinking off: at once


_ALPHABET = st.sampled_from(["<think>", "</think>", "<", "/", ">", "\n", "think", "a", " "])


@given(
    text=st.lists(_ALPHABET, max_size=12).map("".join),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    in_reasoning=st.booleans(),
)
def test_streamed_pieces_add_up_to_the_whole_reading(
    text: str, cuts: list[int], in_reasoning: bool
) -> None:
    cuts = [c for c in cuts if c <= len(text)]
    assert stream(text, cuts, in_reasoning) == parse(text, in_reasoning)


@given(text=st.lists(_ALPHABET, max_size=12).map("".join), in_reasoning=st.booleans())
def test_one_character_at_a_time(text: str, in_reasoning: bool) -> None:
    assert stream(text, list(range(len(text))), in_reasoning) == parse(text, in_reasoning)
