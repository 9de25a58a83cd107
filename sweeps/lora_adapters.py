"""Random LoRA adapters for a model or preset, made with `peft`, for the LoRA benchmarks.

    python -m sweeps.lora_adapters Llama-3.1-8B --num 8 --rank 16 --out /tmp/loras

PEFT lays the adapters out (its config file and tensor names) around the base model built on
the meta device, so no base weights are made; the A and B matrices are random (B too, unlike
PEFT's initialisation, so that the adapters change the output), in bfloat16.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from shared.model_config import resolve_model_source

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: str, num: int, rank: int, out: Path, seed: int = 0) -> list[Path]:
    """`num` adapters of rank `rank` on all seven projections, in out/adapter-<i>."""
    import peft  # a benchmark and test dependency, not the engine's

    source = resolve_model_source(model)
    config_path = source.path if source.format == "preset" else source.path / "config.json"
    config = transformers.AutoConfig.from_pretrained(config_path)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_PROJECTIONS)
    adapted = peft.get_peft_model(base, lora)
    shapes = {name: t.shape for name, t in peft.get_peft_model_state_dict(adapted).items()}
    generator = torch.Generator().manual_seed(seed)
    folders = []
    for index in range(num):
        folder = out / f"adapter-{index}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {
            # A: [r, in] scaled as a unit-variance input would keep the rank's outputs O(1);
            # B: [out, r] small, as after training.
            name: (torch.randn(shape, generator=generator) * _scale(name, shape))
            .to(torch.bfloat16)
            .contiguous()
            for name, shape in shapes.items()
        }
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        adapted.peft_config["default"].save_pretrained(str(folder))
        folders.append(folder)
    return folders


def _scale(name: str, shape: torch.Size) -> float:
    return 1 / math.sqrt(shape[1]) if ".lora_A." in name else 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="A model folder or a preset name.")
    parser.add_argument("--num", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for folder in make_adapters(args.model, args.num, args.rank, args.out, args.seed):
        print(folder)


if __name__ == "__main__":
    main()
