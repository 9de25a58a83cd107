"""Turning generated token ids, a few at a time, into streamed text deltas.

Two layers, each O(new tokens + a small window) per step:

1. Decoding. Byte-level BPE splits one character over several tokens (Chinese, emoji), and
   SentencePiece drops the leading space of the first token it decodes, so a token cannot be
   decoded alone. We decode a short window of tokens whose text was already emitted (the
   context) plus the new ones, and emit the part past the context's text:

       window:  | context (text emitted) | held: text ends mid-character | new ids |
                 decode(window) = context text + delta
                                  ^ _num_window_chars_emitted

   While the window's text ends in U+FFFD the last character may still be incomplete, so that
   tail is held and the window grows until a token completes it; then the window slides to
   its last few tokens.

2. Stop strings (stop_strings.py). Text that might be the start of a stop string is held
   until the next tokens show whether it is; a match cuts the text and ends the stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from services.tokenizer.stop_strings import StopStrings
from shared.hf_tokenizer import decode

REPLACEMENT_CHAR = "\ufffd"  # what decoders emit for incomplete or invalid UTF-8
# Tokens kept as context; enough for merges and leading-space rules at the window's start.
_NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streams the text of one sequence: `add()` per scheduler step, `flush()` at the end.

    The concatenated deltas equal `tokenizer.decode(output_ids)` (with an empty prompt; with a
    prompt, the text that output adds to the prompt's), cut at the first stop string, without
    the U+FFFD of a character left incomplete at the end.
    After a stop string or `flush()`, `add()` returns "".
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = StopStrings(stop, include_stop_str_in_output)
        # Seeding with the prompt's tail makes the first output token decode as it does after
        # the prompt (a leading space SentencePiece would drop at the start of a text).
        self._window_ids = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        self._num_window_chars_emitted = len(self._decode(self._window_ids))
        self._emitted_parts: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._emitted_parts) > 1:
            self._emitted_parts = ["".join(self._emitted_parts)]
        return self._emitted_parts[0] if self._emitted_parts else ""

    @property
    def finished(self) -> bool:
        """A stop string was found or `flush()` was called; no more text will come."""
        return self._finished

    def add(self, token_ids: Sequence[int]) -> str:
        """Append newly generated ids; return the new text that is safe to emit now."""
        if self._finished:
            return ""
        self._window_ids.extend(token_ids)
        return self._emit(self._decode_new_text(), final=False)

    def add_until_stop(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """`add` one token at a time up to the one that completes a stop string: the text,
        and how many of the ids it took. Speculative decoding returns a step's accepted
        drafts together, and those after a stop string are no part of the output."""
        if len(token_ids) == 1 or not self._stops.active:
            return self.add(token_ids), len(token_ids)
        parts = []
        for count, token_id in enumerate(token_ids, start=1):
            parts.append(self.add([token_id]))
            if self._finished:
                return "".join(parts), count
        return "".join(parts), len(token_ids)

    def flush(self) -> str:
        """The request finished for another reason (length, EOS): emit all held text.

        A character the output ends inside of (max_tokens cut a multi-byte character) is
        dropped: its tokens decode to U+FFFD, which the model did not produce.
        NOTE: this also drops a U+FFFD that the model spelled out whole as its very last
        character; the tokenizer's decode cannot tell the two apart (nor can vLLM's).
        """
        if self._finished:
            return ""
        text = self._decode(self._window_ids).rstrip(REPLACEMENT_CHAR)
        return self._emit(text[self._num_window_chars_emitted :], final=True)

    def _decode(self, token_ids: list[int]) -> str:
        # NOTE: clean_up_tokenization_spaces rewrites " ." to "." across the window's edge, so
        # it is not stable under appending; the tokenizers kvflow serves leave it off anyway.
        return decode(
            self._tokenizer,
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_new_text(self) -> str:
        text = self._decode(self._window_ids)
        if text.endswith(REPLACEMENT_CHAR):
            # The tail may be a character whose remaining bytes are in the next tokens: emit
            # only what precedes it, keep the window so those tokens can complete it.
            end = len(text.rstrip(REPLACEMENT_CHAR))
            new_text = text[self._num_window_chars_emitted : end]
            self._num_window_chars_emitted = max(self._num_window_chars_emitted, end)
            return new_text
        new_text = text[self._num_window_chars_emitted :]
        # NOTE: the text ends on a whole character, so the last tokens make a valid context: a
        # window that starts mid-character decodes to the same leading U+FFFD every time.
        self._window_ids = self._window_ids[-_NUM_CONTEXT_TOKENS:]
        self._num_window_chars_emitted = len(self._decode(self._window_ids))
        return new_text

    def _emit(self, new_text: str, final: bool) -> str:
        """Pass decoded text through the stop-string filter; return what can be emitted."""
        out = self._stops.feed(new_text, final)
        self._finished = self._finished or final or self._stops.stop_hit is not None
        if out:
            self._emitted_parts.append(out)
        return out

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.stop_hit


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """The displayable text of one token, for logprobs.

    A token holding part of a multi-byte character decodes to U+FFFD alone; its token string
    (byte-level form such as "ä½") at least tells such tokens apart.
    """
    text = decode(tokenizer, [token_id], skip_special_tokens=False)
    if text and not text.strip(REPLACEMENT_CHAR):
        return str(tokenizer.convert_ids_to_tokens(token_id))
    return text
