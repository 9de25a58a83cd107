"""A GGUF file's tokenizer, converted once and then read from the cache: the same tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.hf_tokenizer import load_tokenizer
from shared.model_config import resolve_model_source

SOURCE = resolve_model_source(None)
TEXTS = ["Hello world", "<|im_start|>user\ncafé naïve 123<|im_end|>", "  spaces\tand\nlines"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_the_converted_tokenizer_is_cached_and_the_cached_one_is_the_same(tmp_path: Path) -> None:
    converted = load_tokenizer(SOURCE, None, str(tmp_path))
    [folder] = (tmp_path / "tokenizers").iterdir()
    assert (folder / "tokenizer.json").is_file()
    cached = load_tokenizer(SOURCE, None, str(tmp_path))
    assert converted is not None and cached is not None
    assert len(cached) == len(converted)
    assert cached.all_special_tokens == converted.all_special_tokens
    assert cached.eos_token_id == converted.eos_token_id
    assert cached.bos_token_id == converted.bos_token_id
    for text in TEXTS:
        ids = converted.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids, skip_special_tokens=True) == converted.decode(
            ids, skip_special_tokens=True
        )
    assert cached.apply_chat_template(MESSAGES, add_generation_prompt=True) == (
        converted.apply_chat_template(MESSAGES, add_generation_prompt=True)
    )
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == [folder.name]  # no staging


def test_an_empty_cache_dir_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_tokenizer(SOURCE, None, "") is not None
    assert list(tmp_path.iterdir()) == []
