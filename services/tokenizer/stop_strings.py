"""Stop strings over streamed text: text that might be the start of a stop string is held
until the next pieces show whether it is; a match cuts the text and ends the stream.

The detokenizer runs it over all of an output's text; with a reasoning parser, the tokenizer
worker runs one over the answer alone (thinking is not searched).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """`feed` per piece of text, `final=True` with the last; after a match, `feed` returns ""."""

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        self._stop = [s for s in stop if s]  # "" would match everywhere: treat it as absent
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop_str = include_stop_str_in_output
        self._held_text = ""  # not yet emitted: might start a stop string
        self.stop_hit: str | None = None

    @property
    def active(self) -> bool:
        """Whether any stop string is still looked for."""
        return bool(self._stop) and self.stop_hit is None

    def feed(self, new_text: str, final: bool = False) -> str:
        """The text that can be emitted now."""
        if self.stop_hit is not None:
            return ""
        text = self._held_text + new_text
        match = self._find_stop(text)
        if match is not None:
            start, stop = match
            self.stop_hit, self._held_text = stop, ""
            return text[: start + len(stop) if self._include_stop_str else start]
        num_held = 0 if final else self._num_chars_to_hold(text)
        self._held_text = text[len(text) - num_held :]
        return text[: len(text) - num_held]

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first in `text`, and where it starts.

        `text` is the held text plus the new text, so this searches only where a match can
        newly end: held text is shorter than any stop string, so earlier positions were searched.
        "First" is by end so the result does not depend on how tokens were chunked: a streaming
        reader sees "bc" before "abcd" in "abcd". On a tie the longer (earlier-starting) wins.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _num_chars_to_hold(self, text: str) -> int:
        """The length of the longest tail of `text` that is a proper prefix of a stop string."""
        for num_chars in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-num_chars:]
            if any(stop.startswith(tail) for stop in self._stop):
                return num_chars
        return 0
