"""Loading the model's tokenizer and chat template from a local folder or GGUF file.

A GGUF file's tokenizer is converted to a Hugging Face one (seconds of CPU for a 50k-token
vocabulary), once: the result is kept as a tokenizer folder under the cache directory, named by
the file (path, size, modification time) and the transformers version that converted it, so the
processes that start later (every tokenizer worker, each `kvflow serve`) read the folder in a
tenth of a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from shared.model_config import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(
    source: ModelSource, override: str | None, cache_dir: str
) -> PreTrainedTokenizerBase | None:
    """The tokenizer for `source`, or None when it ships none (dummy presets). `override`: the
    --tokenizer; `cache_dir`: where a GGUF file's converted tokenizer is kept ("": nowhere)."""
    start = time.perf_counter()
    path = Path(override) if override else source.path
    if path.suffix == ".gguf":
        tokenizer, path = _gguf_tokenizer(path, cache_dir)
    elif path.is_dir() and any((path / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = _folder_tokenizer(path)
    else:
        return None
    logger.info("loaded tokenizer from %s in %.1f s", path, time.perf_counter() - start)
    return tokenizer


def _gguf_tokenizer(path: Path, cache_dir: str) -> tuple[PreTrainedTokenizerBase, Path]:
    """The GGUF file's tokenizer, and where it was read: the cached conversion if there is
    one, else the file (and the conversion is cached)."""
    folder = _cached_folder(path, cache_dir)
    if folder is not None and folder.is_dir():
        return _folder_tokenizer(folder), folder
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if folder is not None:
        _save(tokenizer, folder)
    return tokenizer, path


# The classes a folder may name that are the tokenizers library's backend itself, with nothing
# of a model's own: loaded as that class directly (AutoTokenizer would pick the same one).
_BACKEND_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """A tokenizer folder's tokenizer. Imported here: transformers is a second of a process's
    start (the executor loads a tokenizer only for its first grammar), and AutoTokenizer
    imports torch under it, seconds more of every tokenizer worker's start; a folder whose
    class is the plain backend (every converted GGUF tokenizer) needs neither."""
    config = folder / "tokenizer_config.json"
    named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if named in _BACKEND_CLASSES and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return cast("PreTrainedTokenizerBase", PreTrainedTokenizerFast.from_pretrained(str(folder)))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _cached_folder(path: Path, cache_dir: str) -> Path | None:
    if not cache_dir:
        return None
    import transformers

    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:24]
    return Path(cache_dir).expanduser() / "tokenizers" / f"{path.stem}-{digest}"


def _save(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Write the folder whole or not at all: processes starting together may each convert,
    and the first rename wins. A cache that cannot be written only costs the next start."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=folder.parent, prefix=".staging-")
        tokenizer.save_pretrained(staging)
        try:
            os.rename(staging, folder)
        except OSError:  # another process was first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not cache the converted tokenizer in %s: %s", folder, exc)


# The arguments apply_chat_template sets itself: a request's extra variables may not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
    }
)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt's token ids; `template_kwargs` are extra variables the template sees (e.g.
    Qwen3's `enable_thinking`); none may be one of RESERVED_TEMPLATE_KWARGS."""
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template")
    extra = template_kwargs or {}
    clobbered = sorted(RESERVED_TEMPLATE_KWARGS.intersection(extra))
    if clobbered:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clobbered)}")
    text = tokenizer.apply_chat_template(
        messages,
        tools=cast(list[dict[Any, Any] | Callable[..., Any]] | None, tools),
        tokenize=False,
        add_generation_prompt=True,
        **extra,
    )
    return encode(tokenizer, str(text), add_special_tokens=False)


# transformers declares `str | list[str]` and `Any`; for one sequence these are what it returns.
def decode(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], **kwargs: Any) -> str:
    return cast(str, tokenizer.decode(token_ids, **kwargs))


def encode(tokenizer: PreTrainedTokenizerBase, text: str, **kwargs: Any) -> list[int]:
    return cast(list[int], tokenizer.encode(text, **kwargs))
