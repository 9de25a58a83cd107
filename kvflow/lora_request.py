"""Which LoRA adapter an offline request runs under (vLLM's `LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder, by a name and an id >= 1 that stand for it while the `LLM`
    lives: requests giving the same id share its device slot and its prefix cache."""

    lora_name: str
    lora_int_id: int
    lora_path: str
