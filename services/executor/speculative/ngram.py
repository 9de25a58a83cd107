"""Prompt lookup (vLLM's `ngram` method): the tokens that followed the request's last n tokens
where those n tokens occurred before, in its prompt or its output.

The longest n in [prompt_lookup_min, prompt_lookup_max] that occurs is taken, and of its
occurrences the first: text quoted from the prompt continues as the prompt does, and a loop in
the output is followed for the whole lookahead rather than only to where it was last seen.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from shared.speculative import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to `num_speculative_tokens` drafts to follow `token_ids` (none if no n-gram of
        the allowed lengths ending the sequence occurs earlier in it)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that end before the last token: each leaves at least one to follow.
            windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start : start + self.num_tokens].tolist()
        return []

    def propose_batch(self, requests: Iterable[tuple[str, list[int]]]) -> dict[str, list[int]]:
        """Drafts for each (request id, tokens) given (a request named twice is proposed for
        once), leaving out those it has none for."""
        drafts = {rid: self.propose(tokens) for rid, tokens in dict(requests).items()}
        return {rid: ids for rid, ids in drafts.items() if ids}

    def finished(self, output_token_ids: list[int]) -> None:
        """Nothing: prompt lookup reads only the request's own tokens."""
