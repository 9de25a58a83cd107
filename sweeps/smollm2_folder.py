"""The embedded SmolLM2-135M-Instruct (a Q4_1 GGUF file) written out as a bf16 safetensors
folder: config.json, model.safetensors, the tokenizer and its chat template, as the Hugging
Face hub would hold it. A real-weight model that vLLM serves as well, for speculative
decoding's side-by-side runs (sweeps/spec_acceptance.py, docs/benchmarks.md).

    python -m sweeps.smollm2_folder OUT_FOLDER [--gguf FILE]

transformers reads the GGUF file (dequantizing its blocks, undoing llama.cpp's rotary
permutation of q and k); its model is rebuilt without the GGUF marker, which transformers
refuses to save.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from shared.model_config import embedded_model_path


def write_folder(out: Path, gguf: Path | None = None) -> Path:
    gguf = gguf or Path(embedded_model_path())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(
        out
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the embedded one)")
    args = parser.parse_args()
    write_folder(args.out, args.gguf)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
