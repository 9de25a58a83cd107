"""The LoRA adapters requests may name, as the scheduler process keeps them.

Those of --lora-modules come first, with ids 1, 2, ... (as every component reads the flag);
adapters loaded at run time take the next ids, never reused while the scheduler runs, so a
prefix cached under an adapter is never found under a later one of the same name. A load is
pending until the executor has read and checked the adapter; only then may requests name it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from shared.lora_modules import LoraModule
from shared.protocol import LoraAdapterInfo, NotFoundError, ParameterError


@dataclass(frozen=True)
class PendingLoad:
    request_id: str
    owner: bytes  # the tokenizer worker the answer goes back through
    adapter: LoraAdapterInfo


class LoraRegistry:
    def __init__(self, modules: list[LoraModule], base_model: str = "") -> None:
        self.base_model = base_model  # the served model's name, once the executor said it
        self.adapters: dict[str, LoraAdapterInfo] = {}  # parent "": the base model
        for lora_id, module in enumerate(modules, 1):
            self.adapters[module.name] = LoraAdapterInfo(
                name=module.name, lora_id=lora_id, path=module.path,
                parent=module.base_model_name or "",
            )  # fmt: skip
        self.num_static = len(modules)
        self.pending: dict[int, PendingLoad] = {}
        # When the list last changed (wall-clock ns, so a restarted scheduler's list is newer
        # than any of the one before): a frontend keeps the newest it has seen.
        self.version = time.time_ns()
        self._next_id = len(modules) + 1

    def begin_load(self, request_id: str, owner: bytes, name: str, path: str | None) -> int:
        """The id an adapter takes if the executor can load it; ParameterError if the name is
        taken (or being loaded) or no path is given."""
        if not path:
            raise ParameterError("lora_path", "give the adapter's folder")
        if name in self.adapters or any(p.adapter.name == name for p in self.pending.values()):
            raise ParameterError("lora_name", f"a LoRA adapter named {name!r} is loaded already")
        lora_id, self._next_id = self._next_id, self._next_id + 1
        adapter = LoraAdapterInfo(name=name, lora_id=lora_id, path=path, parent="")
        self.pending[lora_id] = PendingLoad(request_id, owner, adapter)
        return lora_id

    def finish_load(self, lora_id: int, loaded: bool) -> PendingLoad | None:
        """The executor answered: the adapter is taken, if `loaded`; its pending load."""
        pending = self.pending.pop(lora_id, None)
        if pending is not None and loaded:
            self.adapters[pending.adapter.name] = pending.adapter
            self._changed()
        return pending

    def unload(self, name: str) -> LoraAdapterInfo:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise NotFoundError("lora_name", f"no LoRA adapter is named {name!r}")
        self._changed()
        return adapter

    def drop_runtime_loads(self) -> list[str]:
        """Forget the adapters loaded at run time (a new executor has only those of the flag)
        and the loads pending; the names forgotten."""
        dropped = [a.name for a in self.adapters.values() if a.lora_id > self.num_static]
        dropped += [p.adapter.name for p in self.pending.values()]
        for name in dropped:
            self.adapters.pop(name, None)
        self.pending.clear()
        if dropped:
            self._changed()
        return dropped

    def _changed(self) -> None:
        self.version = max(time.time_ns(), self.version + 1)

    def listing(self) -> list[LoraAdapterInfo]:
        return [
            a if a.parent else msgspec.structs.replace(a, parent=self.base_model)
            for a in self.adapters.values()
        ]
