"""/tokenizer_info: what the model's tokenizer_config.json says, read from the loaded tokenizer
(vLLM's route, behind --enable-tokenizer-info-endpoint: a chat template may be private)."""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase


def tokenizer_info(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's configuration as JSON text: its class, special tokens, chat template
    and lengths (what clients need to tokenize as the server does)."""
    info: dict[str, Any] = {
        "tokenizer_class": type(tokenizer).__name__,
        "model_max_length": tokenizer.model_max_length,
        "vocab_size": len(tokenizer),
        "chat_template": tokenizer.chat_template,
        "padding_side": tokenizer.padding_side,
        "truncation_side": tokenizer.truncation_side,
        "clean_up_tokenization_spaces": tokenizer.clean_up_tokenization_spaces,
        # bos_token, eos_token, pad_token, unk_token, additional_special_tokens ... as text
        **{name: _text(value) for name, value in tokenizer.special_tokens_map.items()},
        "added_tokens_decoder": {
            str(token_id): {"content": token.content, "special": token.special}
            for token_id, token in tokenizer.added_tokens_decoder.items()
        },
    }
    return json.dumps(info, default=str)


def _text(value: object) -> object:
    if isinstance(value, list):
        return [str(v) for v in value]
    return str(value)
