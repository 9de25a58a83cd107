"""Pieces the format scanners share: markers split across pieces, JSON values read as far as
they go, call headers decided as soon as their first characters allow, and the content rule.

A header matcher answers a `Header` (the call's name and where its arguments start), `MAYBE`
(the text so far could still become one) or `NO` (it cannot).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from services.tokenizer.tool_parsers.base import Scan, ScannedCall

MAYBE: Literal["maybe"] = "maybe"
NO: Literal["no"] = "no"

# A JSON token for skipping a value: a string (possibly unterminated), a bracket, a stop
# marker's first character, or a run of anything else.
# (Strings as `[^"\\]*(?:\\.[^"\\]*)*`: the unrolled loop, one regex step per escape.)
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}<]|[^"\[\]{}<]+', re.S)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


@dataclass(slots=True)
class Header:
    name: str
    arguments_start: int  # where the arguments' text starts


HeaderMatch = Header | Literal["maybe", "no"]


@dataclass(slots=True)
class Region:
    """What follows a call marker: calls (None: the marker is content), and where it ends
    (None: at the end of the text, still open or cut)."""

    calls: list[ScannedCall] | None
    end: int | None


# Reads the region after a marker: (text, where the region starts, final) -> the region, or
# None while the text so far cannot decide (never when final).
RegionReader = Callable[[str, int, bool], Region | None]


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def json_extent(
    text: str, start: int, final: bool, stops: tuple[str, ...] = (), depth: int = 0
) -> tuple[int, bool]:
    """How far the JSON value at `start` goes: (its end so far, whether it closed).

    With `depth` 1, the rest of an object already open. The value also ends before a stop
    marker outside its strings (invalid JSON there, so the model's markup); before a
    possible start of one, while not final, it ends for now.
    """
    for match in _JSON_TOKEN.finditer(text, start):
        token, pos = match.group(), match.start()
        if token in ("[", "<"):
            for stop in stops:
                if text.startswith(stop, pos):
                    return pos, False
                if not final and stop.startswith(text[pos:]):
                    return pos, False
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            depth -= 1
            if depth <= 0:
                return match.end(), True
    return len(text), False


def match_literals(text: str, pos: int, literals: tuple[str, ...]) -> int | bool | None:
    """After whitespace, one of `literals`: its end; None: maybe still; False: no."""
    pos = skip_whitespace(text, pos)
    for literal in literals:
        if text.startswith(literal, pos):
            return pos + len(literal)
    if any(literal.startswith(text[pos:]) for literal in literals):
        return None
    return False


def match_json_header(text: str, pos: int, argument_keys: tuple[str, ...]) -> HeaderMatch:
    """`{"name": "fn", "arguments": {` (any whitespace, one of `argument_keys`) at `pos`."""
    name = ""
    steps: list[tuple[str, ...] | None] = [("{",), ('"name"',), (":",), None, (",",)]
    steps += [argument_keys, (":",), ("{",)]
    for step in steps:
        if step is None:  # the name: a JSON string
            pos = skip_whitespace(text, pos)
            if pos == len(text):
                return MAYBE
            string = _JSON_STRING.match(text, pos)
            if text[pos] != '"':
                return NO
            if string is None:
                return MAYBE
            try:
                name = json.loads(string.group())
            except ValueError:
                return NO
            pos = string.end()
            continue
        end = match_literals(text, pos, step)
        if end is None:
            return MAYBE
        if end is False:
            return NO
        pos = int(end)
    return Header(name, pos - 1)


def scan_marked(
    text: str, markers: str | tuple[str, ...], final: bool, read_region: RegionReader
) -> Scan:
    """Content and calls of a format whose calls follow a marker (any of `markers`),
    anywhere in the output.

    Content: with no calls, the output unchanged. With calls, the text outside them, where
    each stretch of text before a call loses its trailing whitespace and a whitespace-only
    tail after the last call is dropped. While not final, trailing whitespace and a possible
    start of the marker are held, since a call may follow.
    """
    markers = (markers,) if isinstance(markers, str) else markers
    pieces: list[str] = []  # the text before each call, without trailing whitespace
    calls: list[ScannedCall] = []
    piece_start = pos = 0
    while (found := _first_marker(text, markers, pos)) is not None:
        start, marker = found
        region = read_region(text, start + len(marker), final)
        if region is None:  # undecided: hold the region, and the whitespace before it
            return Scan("".join(pieces) + text[piece_start:start].rstrip(), calls)
        if not region.calls:  # the marker is content; look further
            if region.end is None:
                break
            pos = region.end
            continue
        pieces.append(text[piece_start:start].rstrip())
        calls += region.calls
        if region.end is None:
            return Scan("".join(pieces), calls)
        piece_start = pos = region.end
    tail = text[piece_start:]
    if final:
        return Scan("".join(pieces) + (tail if tail.strip() or not calls else ""), calls)
    held = max(partial_marker_len(tail, marker) for marker in markers)
    stem = tail[: len(tail) - held]
    return Scan("".join(pieces) + stem.rstrip(), calls)


def _first_marker(text: str, markers: tuple[str, ...], pos: int) -> tuple[int, str] | None:
    """The first of `markers` in `text` from `pos`: where, and which."""
    found = [(start, marker) for marker in markers if (start := text.find(marker, pos)) >= 0]
    return min(found) if found else None


def object_text(arguments: list[tuple[str, object]], closed: bool) -> str:
    """The JSON text of an arguments object built key by key; its `}` once it is closed."""
    pairs = ", ".join(
        f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        for key, value in arguments
    )
    return "{" + pairs + ("}" if closed else "")
