"""Loading the model's tokenizer and chat template from a local folder or GGUF file."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shared.model_config import ModelSource

logger = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(
    source: ModelSource, override: str | None = None
) -> PreTrainedTokenizerBase | None:
    """The tokenizer for `source`, or None when it ships none (dummy presets)."""
    start = time.perf_counter()
    path = Path(override) if override else source.path
    if path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    elif path.is_dir() and any((path / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    else:
        return None
    logger.info("loaded tokenizer from %s in %.1f s", path, time.perf_counter() - start)
    return tokenizer


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template")
    text = tokenizer.apply_chat_template(
        messages,
        tools=cast(list[dict[Any, Any] | Callable[..., Any]] | None, tools),
        tokenize=False,
        add_generation_prompt=True,
    )
    return encode(tokenizer, str(text), add_special_tokens=False)


# transformers declares `str | list[str]` and `Any`; for one sequence these are what it returns.
def decode(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], **kwargs: Any) -> str:
    return cast(str, tokenizer.decode(token_ids, **kwargs))


def encode(tokenizer: PreTrainedTokenizerBase, text: str, **kwargs: Any) -> list[int]:
    return cast(list[int], tokenizer.encode(text, **kwargs))
