"""The executor's side of structured output: a matcher per constrained request, and each
step's token bitmask for the rows that have one.

A matcher advances with every token its request gets (`RequestState.append`); the mask of its
next token is computed on the host once the previous token has arrived, while the step's
forward pass runs on the device, and applied to the logits before sampling
(`sampler.apply_token_bitmask`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from shared.grammar import grammar_of, llg_tokenizer, parser_limits
from shared.protocol import StructuredOutput

logger = logging.getLogger(__name__)


class GrammarMatchers:
    """Makes matchers for the model's tokenizer, and fills the bitmasks of a step's rows."""

    def __init__(
        self, load_hf_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        self._load_hf_tokenizer = load_hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: LLTokenizer | None = None
        self._executor: LLExecutor | None = None
        self._eos_row: torch.Tensor | None = None  # the mask of a matcher in its error state

    @property
    def tokenizer(self) -> LLTokenizer:
        """Made on first use (about a second), or by `warm_up`, not at every start."""
        if self._tokenizer is None:
            hf_tokenizer = self._load_hf_tokenizer()
            if hf_tokenizer is None:
                raise ValueError("structured output needs a tokenizer; this model has none")
            self._tokenizer = llg_tokenizer(hf_tokenizer, self.vocab_size, self.eos_token_ids)
        return self._tokenizer

    def matcher(self, spec: StructuredOutput, output_token_ids: list[int]) -> LLMatcher:
        """A matcher for `spec` that has consumed `output_token_ids` (a resumed request's), or
        their part past the reasoning's end (`grammar_input`)."""
        # grammar_of takes microseconds (text, no compile): nothing is cached per schema here.
        matcher = LLMatcher(self.tokenizer, grammar_of(spec), log_level=0, limits=parser_limits())
        output_token_ids = grammar_input(spec, output_token_ids) or []
        if output_token_ids and not matcher.consume_tokens(output_token_ids):
            logger.warning("a resumed request's output does not match its grammar")
        return matcher

    @property
    def width(self) -> int:
        """int32 words per row of a bitmask."""
        return (self.tokenizer.vocab_size + 31) // 32

    def step_bitmask(
        self, rows: list[tuple[int, LLMatcher]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sampler's (rows [G] int64, bitmask [G, width]) for (sampled row, matcher)
        pairs on `device`; None for none."""
        if not rows:
            return None
        bitmask = self.bitmask([matcher for _, matcher in rows], device)
        # Pinned, as every upload of a step: from pageable memory the copy would wait for the
        # forward pass queued before it, and the host would idle instead of preparing the next.
        pinned = device.type == "cuda"
        indices = torch.tensor([row for row, _ in rows], dtype=torch.int64, pin_memory=pinned)
        return indices.to(device, non_blocking=pinned), bitmask

    def bitmask(self, matchers: list[LLMatcher], device: torch.device) -> torch.Tensor:
        """[len(matchers), width] int32 on `device`: bit t of a row allows token t next.

        A matcher in an error state (a token it refused: only possible past the grammar's end,
        e.g. under ignore_eos) allows the EOS tokens alone, so the row ends cleanly.
        """
        # Imported at the first grammar: llguidance.torch brings in torch.compile's machinery
        # (1 s of CPU in every executor start, grammar or not).
        import llguidance.torch

        if self._executor is None:
            self._executor = LLExecutor()
        host = torch.empty(
            (len(matchers), self.width), dtype=torch.int32, pin_memory=device.type == "cuda"
        )
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], host
        )
        for i, matcher in enumerate(matchers):
            if matcher.is_error():
                if self._eos_row is None:
                    self._eos_row = eos_only_row(self.eos_token_ids, self.width)
                host[i] = self._eos_row
        return host.to(device, non_blocking=device.type == "cuda")


def grammar_input(spec: StructuredOutput, output_token_ids: list[int]) -> list[int] | None:
    """The output tokens `spec`'s grammar reads: all of them, or with reasoning end ids, those
    after the first of them; None while the reasoning has not ended (the grammar waits)."""
    ends = spec.reasoning_end_token_ids
    if not ends:
        return output_token_ids
    for i, token_id in enumerate(output_token_ids):
        if token_id in ends:
            return output_token_ids[i + 1 :]
    return None


def eos_only_row(eos_token_ids: list[int], width: int) -> torch.Tensor:
    """A bitmask row [width] int32 that allows the EOS tokens alone."""
    row = torch.zeros(width * 32, dtype=torch.bool)
    row[eos_token_ids] = True
    return pack_bits(row[None])[0]


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[R, 32 * W] bool as the [R, W] int32 bitmask llguidance writes (bit j of word w is
    token 32 w + j); the inverse of `sampler.unpack_bits`."""
    bits = allowed.view(allowed.shape[0], -1, 32).to(torch.int64)  # [R, W, 32]
    words = (bits << torch.arange(32)).sum(dim=-1)  # [R, W] in 0..2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
