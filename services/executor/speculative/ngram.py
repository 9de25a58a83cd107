"""Prompt lookup (vLLM's `ngram` method): the tokens that followed the request's last n tokens
where those n tokens occurred before, in its prompt or its output.

The longest n in [prompt_lookup_min, prompt_lookup_max] that occurs is taken, and of its
occurrences the first: text quoted from the prompt continues as the prompt does, and a loop in
the output is followed for the whole lookahead rather than only to where it was last seen.

Each request keeps an index of where each of its n-grams first occurs, extended by the tokens
that arrived since its last proposal: a proposal is then a few dictionary lookups, where a
search of the whole sequence cost about 55 µs a request (numpy), between every two steps of
a batch whose rows wait for their drafts.
"""

from __future__ import annotations

from collections.abc import Iterable

from shared.speculative import SpeculativeConfig


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a token sequence first starts, for the n-grams
    that end before the sequence's last token (each has a token after it)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.lengths = range(min_n, max_n + 1)
        self.first: dict[tuple[int, ...], int] = {}  # n-grams of every length in one map
        self.tokens: list[int] = []  # the sequence (the executor's list, which only grows)
        self.done = 0  # its length when last indexed

    def extend(self, token_ids: list[int]) -> None:
        """Index the tokens `token_ids` adds to the sequence indexed so far: the same list
        grown, or another that starts as it did; any other is indexed afresh."""
        done = self.done
        if done > len(token_ids) or (
            token_ids is not self.tokens and token_ids[:done] != self.tokens[:done]
        ):
            self.first, done = {}, 0
        for end in range(max(done, 1), len(token_ids)):  # the n-grams followed by token `end`
            for n in self.lengths:
                if end >= n:
                    self.first.setdefault(tuple(token_ids[end - n : end]), end - n)
        self.tokens, self.done = token_ids, len(token_ids)

    def follow(self, num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens after the first earlier occurrence of the longest n-gram
        that ends the sequence."""
        tokens = self.tokens
        for n in reversed(self.lengths):
            if n < len(tokens):
                start = self.first.get(tuple(tokens[-n:]))
                if start is not None:
                    return tokens[start + n : start + n + num_tokens]
        return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, token_ids: list[int]) -> list[int]:
        """Up to `num_speculative_tokens` drafts to follow `token_ids` (none if no n-gram of
        the allowed lengths ending the sequence occurs earlier in it)."""
        index = self.indexes.get(request_id)
        if index is None:
            index = self.indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(token_ids)
        return index.follow(self.num_tokens)

    def propose_batch(self, requests: Iterable[tuple[str, list[int]]]) -> dict[str, list[int]]:
        """Drafts for each (request id, tokens) given (a request named twice is proposed for
        once), leaving out those it has none for."""
        drafts = {rid: self.propose(rid, tokens) for rid, tokens in dict(requests).items()}
        return {rid: ids for rid, ids in drafts.items() if ids}

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        """Drop the request's index (prompt lookup reads only the request's own tokens)."""
        self.indexes.pop(request_id, None)

    def reset(self) -> None:
        self.indexes.clear()
