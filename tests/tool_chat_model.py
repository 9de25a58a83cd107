"""A tiny random-weight Llama with a real tokenizer (the embedded SmolLM2's) and a chat template
that renders tools, tool calls and tool results in the Hermes style (<tool_call> blocks, as
Qwen2.5 and Qwen3 use). Its output is noise, which is what structured-output tests want: only
the grammar can make it parse."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import transformers

# Written for these tests (not any model's template): a system preamble listing the tools,
# assistant calls as <tool_call> JSON blocks, and tool results as <tool_response> blocks.
TOOL_CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You can call these functions. Each is described by a JSON schema:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
To call one, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{% if message.name %}{{ message.name }}: {% endif %}{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def save_tool_chat_model(folder: Path, tokenizer: transformers.PreTrainedTokenizerBase) -> Path:
    """Write the model (config, safetensors) and the tokenizer with TOOL_CHAT_TEMPLATE."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.5,  # a spread-out output distribution: many tokens get picked
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer = copy.deepcopy(tokenizer)  # the caller's keeps its own template
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder
