"""The executor's LoRA adapters: which are registered, which are kept in host memory, which sit
in the device slots, and the slot of every row of a step.

An adapter is registered by id with its name and folder (`add`, which reads and checks it, so a
bad adapter is refused there and then); those of --lora-modules at start, as ids 1, 2, ...
Its weights stay in a host cache of --max-cpu-loras adapters, the least recently used out but
never one in a device slot (its requests may need it again after a refill, even once its
files are gone); one that fell out is read from its folder again when a step needs it.

A step's adapters are put in the device slots (`row_slots`) before its inputs are written:
resident ones keep their slots, others take the slots of adapters the step does not run. Why
no wait for steps in flight before a slot is refilled: the copies are queued on the same
stream as those steps, behind them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.executor.layers.mlp import GatedMLP
from services.executor.lora.adapter import LoraAdapter, LoraAdapterError, load_lora_adapter
from services.executor.lora.slots import FUSED, LoraSlots, SlotTable
from services.executor.models.decoder import DecoderForCausalLM
from shared.lora_modules import LoraModule
from shared.model_config import ModelConfig

logger = logging.getLogger(__name__)

NO_SLOT = -1  # a row of the base model


@dataclass(frozen=True)
class LoraRef:
    name: str
    path: str


class LoraManager:
    def __init__(
        self,
        model: DecoderForCausalLM,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        dtype: torch.dtype,
        device: torch.device,
        modules: list[LoraModule],
    ) -> None:
        self.config: ModelConfig = model.config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.slots = LoraSlots(model.layout, max_loras, max_lora_rank, dtype, device)
        self.table = SlotTable(max_loras)
        self.registered: dict[int, LoraRef] = {}
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()  # least recently used first
        for index, layer in enumerate(model.layers):
            projections = {
                "qkv_proj": layer.self_attn.qkv_proj,
                "o_proj": layer.self_attn.o_proj,
            }
            if isinstance(layer.mlp, GatedMLP):  # a mixture of experts' layer takes none
                projections.update(gate_up_proj=layer.mlp.gate_up_proj,
                                   down_proj=layer.mlp.down_proj)  # fmt: skip
            assert projections.keys() == self.slots.layers[index].keys() <= FUSED.keys()
            for fused, linear in projections.items():
                linear.lora = self.slots.layers[index][fused]
        num_bytes = sum(
            t.numel() * t.element_size()
            for layer in self.slots.layers
            for s in layer.values()
            for t in (s.lora_a, s.lora_b)
        )
        logger.info(
            "LoRA: %d device slots of rank %d (%.2f GiB), adapters up to rank %d, host cache of "
            "%d adapters",
            max_loras, self.slots.rank, num_bytes / 2**30, max_lora_rank, self.max_cpu_loras,
        )  # fmt: skip
        self.modules = [module.name for module in modules]
        for lora_id, module in enumerate(modules, 1):
            self.add(lora_id, module.name, module.path)  # a bad one stops the start

    def reset(self) -> None:
        """Forget the adapters added after the start (a new scheduler names its own)."""
        for lora_id in [i for i in self.registered if i > len(self.modules)]:
            self.remove(lora_id)

    def add(self, lora_id: int, name: str, path: str) -> None:
        """Register an adapter: read and check it now. Raises LoraAdapterError if it cannot
        run on this model, or if `lora_id` already names another adapter."""
        if lora_id < 1:
            raise LoraAdapterError(f"LoRA adapter {name!r}: its id must be >= 1, got {lora_id}")
        ref = LoraRef(name, str(path))
        known = self.registered.get(lora_id)
        if known is not None:
            if known != ref:
                raise LoraAdapterError(
                    f"LoRA adapter id {lora_id} is {known.name!r} ({known.path}) already, "
                    f"not {name!r} ({path})"
                )
            return
        self._cache(lora_id, self._read(ref))
        self.registered[lora_id] = ref
        logger.info("LoRA adapter %r (id %d) loaded from %s", name, lora_id, path)

    def try_add(self, lora_id: int, name: str, path: str) -> str | None:
        """`add`, answering why not (None: taken) rather than raising: whatever its files
        hold, a bad adapter must not end the executor."""
        try:
            self.add(lora_id, name, path)
        except LoraAdapterError as exc:
            return str(exc)
        except Exception as exc:
            logger.exception("LoRA adapter %r from %s could not be read", name, path)
            return f"LoRA adapter {name!r} could not be read: {type(exc).__name__}: {exc}"
        return None

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter; whether it was registered."""
        self._host.pop(lora_id, None)
        self.table.forget(lora_id)
        return self.registered.pop(lora_id, None) is not None

    def row_slots(self, lora_ids: Sequence[int]) -> list[int]:
        """The slot of each row's adapter (NO_SLOT for the base model), filling the slots of
        adapters that are not resident."""
        needed = {lora_id for lora_id in lora_ids if lora_id}
        slots, to_fill = self.table.assign(needed)
        for lora_id, slot in to_fill.items():
            try:
                self.slots.fill(slot, self._adapter(lora_id))
            except Exception:
                self.table.forget(lora_id)  # the slot holds no adapter the table could name
                raise
        return [slots[lora_id] if lora_id else NO_SLOT for lora_id in lora_ids]

    def _adapter(self, lora_id: int) -> LoraAdapter:
        adapter = self._host.get(lora_id)
        if adapter is not None:
            self._host.move_to_end(lora_id)
            return adapter
        ref = self.registered.get(lora_id)
        if ref is None:
            raise LoraAdapterError(f"no LoRA adapter has id {lora_id}")
        adapter = self._read(ref)
        self._cache(lora_id, adapter)
        return adapter

    def _read(self, ref: LoraRef) -> LoraAdapter:
        return load_lora_adapter(ref.name, Path(ref.path), self.config, self.max_lora_rank)

    def _cache(self, lora_id: int, adapter: LoraAdapter) -> None:
        self._host[lora_id] = adapter
        resident = self.table.resident()
        evictable = [i for i in self._host if i not in resident and i != lora_id]
        for victim in evictable[: max(0, len(self._host) - self.max_cpu_loras)]:
            del self._host[victim]
