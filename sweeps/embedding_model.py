"""A model folder in the shape of Qwen3-Embedding-0.6B, for serving with dummy weights: its
published config and sentence-transformers modules (last-token pooling, normalized), and the
tokenizer of a Qwen3 folder (every Qwen3 model shares it).

    python -m sweeps.embedding_model QWEN3_FOLDER OUT_FOLDER

The vocabulary is the tokenizer folder's (151,936 in the Qwen3-8B folder of the steering
repo's peer/: every id a random prompt draws must exist), not the published 151,669; the
embedding table is not on the hot path of an embedding request.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {
        "idx": 2,
        "name": "2",
        "path": "2_Normalize",
        "type": "sentence_transformers.models.Normalize",
    },
]
POOLING = {"word_embedding_dimension": 1024, "pooling_mode_lasttoken": True}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def write(qwen3: Path, out: Path) -> None:
    vocab = json.loads((qwen3 / "config.json").read_text())["vocab_size"]
    (out / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": vocab}, indent=1))
    (out / "modules.json").write_text(json.dumps(MODULES, indent=1))
    (out / "1_Pooling" / "config.json").write_text(json.dumps(POOLING, indent=1))
    for name in TOKENIZER_FILES:
        if (qwen3 / name).exists():
            shutil.copy(qwen3 / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("qwen3", type=Path, help="A Qwen3 model folder (its tokenizer).")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    write(args.qwen3, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
