"""The requests a serving benchmark sends: random token ids, shared prefixes, or ShareGPT."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

# Without a tokenizer, random prompts draw ids below this: every supported vocabulary has
# more ids than that, so any model accepts them.
DEFAULT_VOCAB_BOUND = 32000
FIRST_RANDOM_ID = 100  # skips the low ids where tokenizers keep special and byte tokens


class Tokenizer(Protocol):
    """What the datasets need of a tokenizer (a Hugging Face one fits)."""

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class SampleRequest:
    # text, token ids for /v1/completions, or a batch of token-id prompts for /v1/embeddings
    prompt: str | list[int] | list[list[int]]
    prompt_len: int | None  # in tokens, where known before sending (the server's usage says)
    output_len: int  # max_tokens


def batched(requests: list[SampleRequest], batch_size: int) -> list[SampleRequest]:
    """The random dataset's token-id prompts in requests of `batch_size` (the last may hold
    fewer): an embedding request's `input` list (vLLM's --random-batch-size)."""
    batches = []
    for start in range(0, len(requests), batch_size):
        group = requests[start : start + batch_size]
        prompts = [cast(list[int], r.prompt) for r in group]
        batches.append(SampleRequest(prompts, sum(r.prompt_len or 0 for r in group), 0))
    return batches


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    """`count` lengths uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    low, high = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def _random_ids(rng: random.Random, length: int, vocab_bound: int) -> list[int]:
    return [rng.randrange(FIRST_RANDOM_ID, vocab_bound) for _ in range(length)]


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    vocab_bound: int = DEFAULT_VOCAB_BOUND,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Prompts of random token ids: distinct, so no prefix cache helps (seed them apart),
    unless `prefix_len` ids of one random prefix open every prompt."""
    rng = random.Random(seed)
    inputs = _lengths(rng, input_len, range_ratio, num)
    outputs = _lengths(rng, output_len, range_ratio, num)
    prefix = _random_ids(rng, prefix_len, vocab_bound)
    return [
        SampleRequest(prefix + _random_ids(rng, n_in, vocab_bound), prefix_len + n_in, n_out)
        for n_in, n_out in zip(inputs, outputs, strict=True)
    ]


def prefix_repetition_requests(
    num: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int,
    vocab_bound: int = DEFAULT_VOCAB_BOUND,
) -> list[SampleRequest]:
    """Each prompt is one of `num_prefixes` shared prefixes and a suffix of its own."""
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab_bound) for _ in range(num_prefixes)]
    return [
        SampleRequest(
            prefixes[i % num_prefixes] + _random_ids(rng, suffix_len, vocab_bound),
            prefix_len + suffix_len,
            output_len,
        )
        for i in range(num)
    ]


def sharegpt_requests(
    path: Path,
    num: int,
    seed: int,
    tokenizer: Tokenizer | None,
    output_len: int | None,
    shuffle: bool = True,
    oversample: bool = True,
) -> list[SampleRequest]:
    """The first human turn of conversations from a ShareGPT-format JSON file as prompts,
    shuffled unless `shuffle` is off, repeated up to `num` unless `oversample` is off.

    The output length is the reference reply's token count (needs `tokenizer`) unless
    `output_len` fixes it; conversations without a human turn followed by a reply are skipped.
    """
    if tokenizer is None and output_len is None:
        raise ValueError("the sharegpt dataset needs --tokenizer or --sharegpt-output-len")
    entries: Any = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [pair for entry in entries if (pair := _first_exchange(entry)) is not None]
    if not pairs:
        raise ValueError(f"{path}: no conversation has a human turn followed by a reply")
    if shuffle:
        random.Random(seed).shuffle(pairs)
    repeats = num // len(pairs) + 1 if oversample else 1
    requests = []
    for prompt, reply in (pairs * repeats)[:num]:
        prompt_len = None if tokenizer is None else len(tokenizer.encode(prompt))
        if output_len is not None:
            reply_len = output_len
        else:
            assert tokenizer is not None
            reply_len = max(1, len(tokenizer.encode(reply, add_special_tokens=False)))
        requests.append(SampleRequest(prompt, prompt_len, reply_len))
    return requests


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") != "human" or not isinstance(first.get("value"), str):
        return None
    if not isinstance(second.get("value"), str):
        return None
    return first["value"], second["value"]
