"""Test helpers: stream an output through a tool-call parser in pieces and check it against
`parse`, and a hypothesis strategy for outputs split at random points."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import strategies as st

from services.tokenizer.tool_parsers import ToolParser, tool_parser
from shared.protocol import ToolDefinition


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the (name, arguments) calls a client assembles from the deltas."""
    content = ""
    names: dict[int, str] = {}
    ids: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in [*(parser.feed(piece) for piece in pieces), parser.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            if call.id is None:  # a later delta of a call already opened
                assert call.index in ids and call.name is None
            else:
                assert call.index not in ids and call.name is not None
                ids[call.index], names[call.index] = call.id, call.name
            arguments[call.index] = arguments.get(call.index, "") + call.arguments
    assert sorted(ids) == list(range(len(ids)))
    assert len(set(ids.values())) == len(ids)
    return content, [(names[i], arguments[i]) for i in sorted(ids)]


def check_stream_matches_parse(
    name: str, text: str, pieces: list[str], tools: Sequence[ToolDefinition] | None = None
) -> None:
    assert "".join(pieces) == text
    content, calls = tool_parser(name, tools).parse(text)
    assert content is not None or calls
    assert stream(tool_parser(name, tools), pieces) == (
        content or "",
        [(call.name, call.arguments) for call in calls],
    )


@st.composite
def texts_and_pieces(
    draw: st.DrawFn, parts: list[str], endings: list[str]
) -> tuple[str, list[str]]:
    """A text made of `parts` and one of `endings`, and its pieces at random split points."""
    text = "".join(draw(st.lists(st.sampled_from(parts), max_size=6)))
    text += draw(st.sampled_from(endings))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    return text, [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
