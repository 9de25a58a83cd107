"""Suffix decoding (vLLM's `suffix` method, after Oliaro et al., 2024): drafts from the longest
suffix of the request's tokens that occurred before, in the request itself or in the outputs
of recent requests, following the most frequent continuation while it stays likely.

What a suffix tree's node holds for a pattern (where it occurs, and how often each token
followed it) is found here by search: the occurrences of the request's last token, narrowed
one token further back at a time while any still match (up to `max_tree_depth` tokens), give
the deepest node; the draft then walks down its most frequent children. The path's probability
(the product of each step's share of the occurrences) must stay at least `min_token_prob`,
and the draft is at most `max_spec_factor` times the match's length: a long match is trusted
further than a short one. Of the two sources, the draft with the larger expected number of
accepted tokens (the sum of its path probabilities) is taken.

The recent outputs are kept in a ring of `CACHE_TOKENS` tokens, the outputs of at most
`max_cached_requests` requests (0: none), searched whole at each proposal: a bound on the work
a step's proposals cost rather than an index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np

from shared.speculative import SpeculativeConfig

CACHE_TOKENS = 1 << 16  # the recent outputs searched, at most
_SEPARATOR = -1  # between two requests' outputs: never matches, never drafted


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.max_depth = config.suffix_max_tree_depth
        self.spec_factor = config.suffix_max_spec_factor
        self.min_prob = config.suffix_min_token_prob
        self.max_cached = config.suffix_max_cached_requests
        self._cached: deque[np.ndarray] = deque()
        self._num_cached_tokens = 0
        self._cache = np.full(0, _SEPARATOR, dtype=np.int64)  # the outputs, separated

    def propose_batch(self, requests: Iterable[tuple[str, list[int]]]) -> dict[str, list[int]]:
        """Drafts for each (request id, tokens) given, leaving out those it has none for."""
        drafts = {rid: self.propose(tokens) for rid, tokens in dict(requests).items()}
        return {rid: ids for rid, ids in drafts.items() if ids}

    def propose(self, token_ids: list[int]) -> list[int]:
        """The likelier of the drafts the request's own tokens and the recent outputs give."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        own = self._draft(tokens, tokens, len(tokens) - 1)  # not the suffix itself
        recent = self._draft(self._cache, tokens, len(self._cache))
        return max(own, recent, key=lambda draft: draft[1])[0]

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        """Keep an ended request's output for the requests after it."""
        if not self.max_cached or not output_token_ids:
            return
        self._cached.append(np.asarray(output_token_ids[-CACHE_TOKENS:], dtype=np.int64))
        self._num_cached_tokens += len(self._cached[-1])
        while len(self._cached) > self.max_cached or self._num_cached_tokens > CACHE_TOKENS:
            self._num_cached_tokens -= len(self._cached.popleft())
        separator = np.full(1, _SEPARATOR, dtype=np.int64)
        self._cache = np.concatenate([part for out in self._cached for part in (out, separator)])

    def reset(self) -> None:
        """Nothing: it holds no request's state, and the outputs it keeps stay worth reading."""

    def _draft(self, hay: np.ndarray, tokens: np.ndarray, end: int) -> tuple[list[int], float]:
        """A draft following `tokens` from their longest suffix's occurrences in `hay` that end
        before `end`, and its expected number of accepted tokens."""
        starts, length = self._match(hay, tokens, end)
        limit = min(self.num_tokens, int(self.spec_factor * length))
        draft: list[int] = []
        prob, score = 1.0, 0.0
        while starts.size and len(draft) < limit:
            following = hay[starts[starts < len(hay)]]
            values, counts = np.unique(following[following != _SEPARATOR], return_counts=True)
            if not values.size:
                break
            best = int(counts.argmax())
            prob *= counts[best] / starts.size
            if prob < self.min_prob:
                break
            draft.append(int(values[best]))
            score += prob
            kept = starts[starts < len(hay)]
            starts = kept[hay[kept] == values[best]] + 1
        return draft, score

    def _match(self, hay: np.ndarray, tokens: np.ndarray, end: int) -> tuple[np.ndarray, int]:
        """Where what follows the longest suffix of `tokens` found in `hay[:end]` starts (one
        index per occurrence), and that suffix's length (0: not even the last token occurs)."""
        starts = np.flatnonzero(hay[:end] == tokens[-1]) + 1
        length = 1
        while starts.size and length < min(self.max_depth, len(tokens)):
            back = starts - 1 - length
            inside = back >= 0
            narrower = starts[inside][hay[back[inside]] == tokens[-1 - length]]
            if not narrower.size:
                break
            starts, length = narrower, length + 1
        return (starts, length) if starts.size else (starts, 0)
