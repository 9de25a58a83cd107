"""Separating a reasoning model's thinking from its answer, by the server's --reasoning-parser.

Both parsers read `<think>` ... `</think>` text (the tags are plain added tokens, which
decoding keeps); they differ in where an output starts when it does not open with `<think>`:

- deepseek_r1: the chat template opened `<think>`, so the output starts inside the reasoning;
  everything up to `</think>` is reasoning, and with no `</think>` all of it is.
- qwen3: the model opens `<think>` itself when thinking is on; an output that does not start
  with it is all answer (thinking off: the template wrote an empty `<think></think>` into the
  prompt). A template that opened `<think>` in the prompt (Qwen3 thinking-only models) makes
  it start inside the reasoning, as deepseek_r1's does.

The tags and the newlines right after `</think>` are dropped.

NOTE: vLLM's whole-output qwen3 parser calls an output with `<think>` but no `</think>` (cut
by max_tokens) all answer, while its stream sends that text as reasoning. Here the whole and
the streamed reading agree (reasoning), which lets the reasoning stream as it is written: the
start decides the mode, never text that comes later.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")  # the last: harmony.py


@dataclass(frozen=True)
class ReasoningSplit:
    """A piece of output read apart: thinking, then answer (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningSplit) -> ReasoningSplit:
        return ReasoningSplit(self.reasoning + other.reasoning, self.content + other.content)


def starts_in_reasoning(parser: str, prompt_text: str) -> bool:
    """Whether an output with no `<think>` of its own is reasoning from its first character:
    always for deepseek_r1; for qwen3 when the prompt ends with an open `<think>`."""
    if parser not in REASONING_PARSERS[:2]:
        raise ValueError(f"unknown reasoning parser {parser!r}")
    return parser == "deepseek_r1" or prompt_text.rstrip().endswith(THINK_START)


def parse(text: str, in_reasoning: bool) -> ReasoningSplit:
    """A whole output read apart; `in_reasoning` as `starts_in_reasoning` says."""
    if text.startswith(THINK_START):
        text, in_reasoning = text[len(THINK_START) :], True
    if not in_reasoning:
        return ReasoningSplit(content=text)
    reasoning, end, content = text.partition(THINK_END)
    return ReasoningSplit(reasoning, content.lstrip("\n") if end else "")


class ReasoningReader:
    """Reads one output as it streams: `feed` per piece of text (split anywhere, a tag too),
    `finish` at the end. The pieces add up to `parse` of the whole text.

    Text is held only while it may be a tag's start, or newlines after `</think>`:

        <think>  reasoning ...  </think>  \\n\\n  content ...
        ^start   ^REASONING      ^end      ^AFTER_END ^CONTENT
    """

    _START, _REASONING, _AFTER_END, _CONTENT = range(4)

    def __init__(self, in_reasoning: bool) -> None:
        self._default = self._REASONING if in_reasoning else self._CONTENT
        self._state = self._START
        self._held = ""  # text not read yet: a possible tag's start

    @property
    def thinking(self) -> bool:
        """Whether the output is in its thinking now (before its start is read: whether it
        starts there without a `<think>` of its own)."""
        if self._state == self._START:
            return self._default == self._REASONING
        return self._state == self._REASONING

    def feed(self, text: str) -> ReasoningSplit:
        self._held += text
        out = ReasoningSplit()
        while self._held:
            before = (self._state, self._held)
            out += self._step()
            if (self._state, self._held) == before:  # waiting for more text
                break
        return out

    def finish(self) -> ReasoningSplit:
        """The output ended: held text is what it looked like it might not be."""
        held, self._held = self._held, ""
        if self._state == self._START:
            self._state = self._default
        if self._state == self._REASONING:
            return ReasoningSplit(reasoning=held)
        if self._state == self._CONTENT:
            return ReasoningSplit(content=held)
        return ReasoningSplit()  # newlines after </think>: dropped

    def _step(self) -> ReasoningSplit:
        held = self._held
        if self._state == self._START:
            if held.startswith(THINK_START):
                self._held, self._state = held[len(THINK_START) :], self._REASONING
            elif not THINK_START.startswith(held):
                self._state = self._default
            return ReasoningSplit()
        if self._state == self._REASONING:
            return self._reasoning(held)
        if self._state == self._AFTER_END:
            rest = held.lstrip("\n")
            self._held = rest
            if rest:
                self._state = self._CONTENT
            return ReasoningSplit()
        self._held = ""
        return ReasoningSplit(content=held)

    def _reasoning(self, held: str) -> ReasoningSplit:
        reasoning, end, rest = held.partition(THINK_END)
        if end:
            self._held, self._state = rest, self._AFTER_END
            return ReasoningSplit(reasoning=reasoning)
        num_held = _partial_tag_len(held, THINK_END)
        self._held = held[len(held) - num_held :]
        return ReasoningSplit(reasoning=held[: len(held) - num_held])


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for num_chars in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-num_chars:]):
            return num_chars
    return 0
