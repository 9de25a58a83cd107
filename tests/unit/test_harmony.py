"""gpt-oss's harmony output read apart (`--reasoning-parser openai_gptoss`): the analysis
channel is thinking, the final and commentary channels the answer, headers and markers gone;
read in one piece or streamed cut anywhere, the same."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.tokenizer.harmony import HarmonyReader
from services.tokenizer.reasoning import ReasoningSplit

THOUGHT = "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"


def read(pieces: list[str], keep_calls: bool = False) -> ReasoningSplit:
    reader = HarmonyReader(keep_calls)
    out = ReasoningSplit()
    for piece in pieces:
        out += reader.feed(piece)
    return out + reader.finish()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (THOUGHT + ANSWER, ReasoningSplit("User asks 2+2. Easy.", "It is 4.")),
        # two analysis messages, then a preamble on commentary and the answer
        (
            THOUGHT + "<|start|>assistant<|channel|>analysis<|message|> More.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + ANSWER,
            ReasoningSplit("User asks 2+2. Easy. More.", "Checking.It is 4."),
        ),
        # a tool call's arguments (commentary to a recipient): the answer's text for now
        (
            THOUGHT + "<|start|>assistant<|channel|>commentary to=functions.add "
            '<|constrain|>json<|message|>{"a":2}<|call|>',
            ReasoningSplit("User asks 2+2. Easy.", '{"a":2}'),
        ),
        # cut by max_tokens in the thinking, in a header, before any body
        ("<|channel|>analysis<|message|>still thinking", ReasoningSplit("still thinking", "")),
        (THOUGHT + "<|start|>assistant<|chan", ReasoningSplit("User asks 2+2. Easy.", "")),
        ("<|channel|>analysis", ReasoningSplit()),
        ("", ReasoningSplit()),
        # no headers at all (plain text): all answer; a '<' that is no marker stays
        ("It is 4.", ReasoningSplit("", "It is 4.")),
        ("<|channel|>final<|message|>a < b", ReasoningSplit("", "a < b")),
    ],
)
def test_a_whole_output(text: str, expected: ReasoningSplit) -> None:
    assert read([text]) == expected


def test_calls_are_marked_for_the_openai_tool_parser() -> None:
    """With keep_calls, a message to a function goes into the answer as the `openai` tool call
    parser reads it, whatever its channel; the recipient may sit in either part of the
    header."""
    call = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a":2}<|call|>'
    marked = '<|start|>functions.add<|message|>{"a":2}<|call|>'
    assert read([THOUGHT + "<|start|>assistant" + call], keep_calls=True) == ReasoningSplit(
        "User asks 2+2. Easy.", marked
    )
    other = '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a":2}'
    assert read([other], keep_calls=True) == ReasoningSplit("", marked[: -len("<|call|>")])


def test_thinking_follows_the_channel() -> None:
    reader = HarmonyReader()
    assert reader.thinking  # before the first header is read
    reader.feed("<|channel|>analysis<|message|>hmm")
    assert reader.thinking
    reader.feed("<|end|><|start|>assistant<|channel|>final<|message|>It")
    assert not reader.thinking


_PIECES = st.sampled_from(
    ["<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>",
     "assistant", "<|return|>", "<|call|>", " to=functions.f", "a", " ", "<", "|", ">", "<|"]
)  # fmt: skip


@given(
    text=st.lists(_PIECES, max_size=14).map("".join),
    cuts=st.lists(st.integers(0, 60)),
    keep_calls=st.booleans(),
)
def test_streamed_reading_adds_up_to_the_whole(
    text: str, cuts: list[int], keep_calls: bool
) -> None:
    """However the text is cut into pieces (inside markers too), the pieces' reading is the
    whole text's."""
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert read(pieces, keep_calls) == read([text], keep_calls)
