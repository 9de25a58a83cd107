"""gpt-oss's harmony format read apart into thinking and answer (`--reasoning-parser
openai_gptoss`, vLLM's name).

The chat template ends the prompt with `<|start|>assistant`; the output is then messages, each a
header and a body:

    <|channel|>analysis<|message|>thinking ...<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer ...<|return|>

The `analysis` channel is the thinking; the `final` channel, and `commentary` (a preamble), the
answer. A message to a function (`<|channel|>commentary to=functions.f <|constrain|>json
<|message|>{...}<|call|>`, the recipient in the header) is a tool call: with the `openai` tool
call parser its arguments go into the answer as `<|start|>functions.f<|message|>{...}<|call|>`
for that parser to read (services/tokenizer/tool_parsers/openai.py), without it they are
answer text. Headers and the markers (special tokens: the detokenizer keeps them for this
parser) are dropped. An output with no header (a model that writes plain text) is all answer.
"""

from __future__ import annotations

import re

from services.tokenizer.reasoning import ReasoningSplit

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
BODY_ENDS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>")  # what ends a message's body
THINKING_CHANNEL = "analysis"
RECIPIENT = re.compile(r"to=(functions\.[^\s<]+)")  # a message to a function: a tool call
CALL_START, CALL_END = "<|start|>", "<|call|>"  # a call as the answer carries it


class HarmonyReader:
    """Reads one output as it streams, as services/tokenizer/reasoning.ReasoningReader does:
    `feed` per piece of text (split anywhere, a marker too), `finish` at the end."""

    def __init__(self, keep_calls: bool = False) -> None:
        """`keep_calls`: messages to functions go into the answer marked for the `openai`
        tool call parser (the module's docstring)."""
        self._keep_calls = keep_calls
        self._in_header = True  # the output starts with a message's header
        self._channel = ""  # the body's channel
        self._recipient = ""  # a function the body is a call to ("functions.f")
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
        if not found:
            return ReasoningSplit()
        channel = header.partition(CHANNEL)[2].split("<|")[0].split()
        self._channel = channel[0] if channel else "final"
        recipient = RECIPIENT.search(header)
        self._recipient = recipient[1] if recipient and self._keep_calls else ""
        self._in_header, self._held = False, rest
        if self._recipient:  # a call's start, for the tool call parser
            return ReasoningSplit(content=f"{CALL_START}{self._recipient}{MESSAGE}")
        return ReasoningSplit()

    def _body(self) -> ReasoningSplit:
        held = self._held
        ends = [(held.find(end), end) for end in BODY_ENDS if end in held]
        if ends:
            at, end = min(ends)
            self._held, self._in_header = held[at + len(end) :], True
            if end == "<|start|>":  # a header follows at once
                self._held = end + self._held
            body = self._as_channel(held[:at])
            if self._recipient:  # the call's end
                body += ReasoningSplit(content=CALL_END)
                self._recipient = ""
            return body
        num_held = max(_partial_marker_len(held, end) for end in BODY_ENDS)
        self._held = held[len(held) - num_held :]
        return self._as_channel(held[: len(held) - num_held])

    def _as_channel(self, text: str) -> ReasoningSplit:
        if self._channel == THINKING_CHANNEL and not self._recipient:
            return ReasoningSplit(reasoning=text)
        return ReasoningSplit(content=text)


def _partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker`."""
    for num_chars in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-num_chars:]):
            return num_chars
    return 0
