"""gpt-oss's harmony format read apart into thinking and answer (`--reasoning-parser
openai_gptoss`, vLLM's name).

The chat template ends the prompt with `<|start|>assistant`; the output is then messages, each a
header and a body:

    <|channel|>analysis<|message|>thinking ...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer ...<|return|>

The `analysis` channel is the thinking; the `final` channel, and `commentary` (a preamble, or a
tool call's arguments: `<|channel|>commentary to=functions.f <|constrain|>json<|message|>...`,
not read into tool calls yet), the answer. Headers and the markers (special tokens: the
detokenizer keeps them for this parser, `keeps_special_tokens`) are dropped. An output with no
header (a model that writes plain text) is all answer.
"""

from __future__ import annotations

from services.tokenizer.reasoning import ReasoningSplit

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")  # what ends a message's body
THINKING_CHANNEL = "analysis"


class HarmonyReader:
    """Reads one output as it streams, as services/tokenizer/reasoning.ReasoningReader does:
    `feed` per piece of text (split anywhere, a marker too), `finish` at the end."""

    def __init__(self) -> None:
        self._in_header = True  # the output starts with a message's header
        self._channel = ""  # the body's channel
        self._held = ""

    @property
    def thinking(self) -> bool:
        """Whether the output is in thinking now (a header: whether its channel is, as the
        first message's usually is)."""
        return self._channel == THINKING_CHANNEL or (self._in_header and not self._channel)

    def feed(self, text: str) -> ReasoningSplit:
        self._held += text
        out = ReasoningSplit()
        while self._held:
            before = (self._in_header, self._held)
            out += self._header() if self._in_header else self._body()
            if (self._in_header, self._held) == before:  # waiting for more text
                break
        return out

    def finish(self) -> ReasoningSplit:
        held, self._held = self._held, ""
        if self._in_header:
            return ReasoningSplit()  # a header cut short: no body
        return self._as_channel(held)

    def _header(self) -> ReasoningSplit:
        held = self._held
        if not self._channel and not held.startswith("<|") and not "<|".startswith(held):
            self._in_header, self._channel = False, "final"  # plain text: no headers
            return ReasoningSplit()
        header, found, rest = held.partition(MESSAGE)
        if found:
            channel = header.partition(CHANNEL)[2].split("<|")[0].split()
            self._channel = channel[0] if channel else "final"
            self._in_header, self._held = False, rest
        return ReasoningSplit()

    def _body(self) -> ReasoningSplit:
        held = self._held
        ends = [(held.find(end), end) for end in BODY_ENDS if end in held]
        if ends:
            at, end = min(ends)
            self._held, self._in_header = held[at + len(end) :], True
            if end == "<|start|>":  # a header follows at once
                self._held = end + self._held
            return self._as_channel(held[:at])
        num_held = max(_partial_marker_len(held, end) for end in BODY_ENDS)
        self._held = held[len(held) - num_held :]
        return self._as_channel(held[: len(held) - num_held])

    def _as_channel(self, text: str) -> ReasoningSplit:
        if self._channel == THINKING_CHANNEL:
            return ReasoningSplit(reasoning=text)
        return ReasoningSplit(content=text)


def _partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for num_chars in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-num_chars:]):
            return num_chars
    return 0
