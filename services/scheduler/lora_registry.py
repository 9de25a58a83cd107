"""The LoRA adapters requests may name, as one engine replica's scheduler keeps them.

Those of --lora-modules come first, with ids 1, 2, ... (as every component reads the flag).
An adapter loaded at run time is named only once every replica holds it (the tokenizer worker
that carries the load out commits it: services/tokenizer/lora_fanout.py):

    begin_load ─▶ pending (the executor reads and checks it) ─▶ held ─▶ commit ─▶ named
                         └─ finish_load(loaded=False): forgotten
    discard (by id, or by the load's request), unload (by name): forgotten, whichever of the
    three it is

A name has one of them at most. The first replica's registry gives a load its id (the next
one); the others take the id they are given. No id is taken twice, so a prefix cached under an
adapter is never found under a later one of the same name. The scheduler process starts
runtime ids from the clock (`clock_id`: milliseconds since the epoch), so that a restarted
scheduler gives none it gave before, which its executor and the other replicas still hold (its
ids would need more than a load a millisecond since its last start to catch up).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from shared.lora_modules import LoraModule, static_adapters
from shared.protocol import LoraAdapterInfo, NotFoundError, ParameterError


def clock_id() -> int:
    """An id above any a scheduler started earlier gave (see the module's docstring)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class PendingLoad:
    request_id: str
    owner: bytes  # the tokenizer worker the answer goes back through
    adapter: LoraAdapterInfo


class LoraRegistry:
    def __init__(
        self, modules: list[LoraModule], base_model: str = "", first_runtime_id: int = 0
    ) -> None:
        self.base_model = base_model  # the served model's name, once the executor said it
        self.adapters = static_adapters(modules)  # named; parent "": the base model
        self.num_static = len(modules)
        self.pending: dict[int, PendingLoad] = {}  # the executor is reading them
        self.held: dict[int, PendingLoad] = {}  # the executor holds them; not named yet
        # When the list last changed (wall-clock ns, so a restarted scheduler's list is newer
        # than any of the one before): a frontend keeps the newest it has seen.
        self.version = time.time_ns()
        self._taken_ids = set(range(1, len(modules) + 1))
        self._next_id = max(len(modules) + 1, first_runtime_id)  # above every id taken

    def begin_load(
        self,
        request_id: str,
        owner: bytes,
        name: str,
        path: str | None,
        lora_id: int | None = None,
    ) -> int:
        """The id an adapter takes if the executor can load it: `lora_id`, or the next one if
        None. ParameterError if the name is taken (named, or a load of it under way), no path is
        given, or `lora_id` was taken before."""
        if not path:
            raise ParameterError("lora_path", "give the adapter's folder")
        loading = [*self.pending.values(), *self.held.values()]
        if name in self.adapters or any(load.adapter.name == name for load in loading):
            raise ParameterError("lora_name", f"a LoRA adapter named {name!r} is loaded already")
        lora_id = self._take_id(lora_id)
        adapter = LoraAdapterInfo(name=name, lora_id=lora_id, path=path, parent="")
        self.pending[lora_id] = PendingLoad(request_id, owner, adapter)
        return lora_id

    def _take_id(self, lora_id: int | None) -> int:
        if lora_id is None:
            lora_id = self._next_id
        elif lora_id < 1 or lora_id in self._taken_ids:
            # Given twice: the first replica's clock went back past a restart.
            raise ParameterError("lora_id", f"this replica took LoRA adapter id {lora_id} before")
        self._taken_ids.add(lora_id)
        self._next_id = max(self._next_id, lora_id + 1)
        return lora_id

    def finish_load(self, lora_id: int, loaded: bool) -> PendingLoad | None:
        """The executor answered: the adapter is held, if `loaded`; its pending load (None if
        it was discarded meanwhile)."""
        pending = self.pending.pop(lora_id, None)
        if pending is not None and loaded:
            self.held[lora_id] = pending
        return pending

    def commit(self, lora_id: int) -> LoraAdapterInfo | None:
        """Name a held adapter; None if it is no longer held (unloaded meanwhile, or dropped
        with a replaced executor)."""
        held = self.held.pop(lora_id, None)
        if held is None:
            return None
        self.adapters[held.adapter.name] = held.adapter
        self._changed()
        return held.adapter

    def discard(self, lora_id: int | None, request_id: str) -> LoraAdapterInfo | None:
        """Forget the load of `lora_id`, or (None: its id never reached the worker that asked)
        of the load `request_id` asked for, wherever it is (a load that not every replica could
        take, or not in time): the adapter forgotten, or None. Its executor's answer, if still
        to come, finds nothing to finish."""
        if lora_id is None:
            loads = {**self.pending, **self.held}.values()
            lora_id = next((p.adapter.lora_id for p in loads if p.request_id == request_id), None)
            if lora_id is None:
                return None
        pending = self.pending.pop(lora_id, None)
        held = self.held.pop(lora_id, None)
        named = next((a for a in self.adapters.values() if a.lora_id == lora_id), None)
        if named is not None:
            del self.adapters[named.name]
            self._changed()
        load = held or pending
        return named or (load.adapter if load else None)

    @property
    def next_id(self) -> int:
        """The id the next load named here takes: every id taken so far is below it."""
        return self._next_id

    def unload(
        self, name: str, below: int | None = None
    ) -> tuple[LoraAdapterInfo, PendingLoad | None]:
        """Forget the adapter of that name, named, held or pending (a load on its way, which
        then fails; or one whose worker went before committing it), if its id is below
        `below`: the adapter, and its load if it was pending (to be answered now).
        NotFoundError if there is none."""
        named = self.adapters.get(name)
        held = next((p.adapter for p in self.held.values() if p.adapter.name == name), None)
        pending = next((p for p in self.pending.values() if p.adapter.name == name), None)
        adapter = named or held or (pending.adapter if pending else None)
        if adapter is None or (below is not None and adapter.lora_id >= below):
            raise NotFoundError("lora_name", f"no LoRA adapter is named {name!r}")
        if named is not None:
            del self.adapters[name]
            self._changed()
        self.held.pop(adapter.lora_id, None)
        self.pending.pop(adapter.lora_id, None)
        return adapter, pending

    def drop_runtime_loads(self) -> list[str]:
        """Forget the adapters loaded at run time (a new executor has only those of the flag)
        and the loads under way; the names forgotten."""
        dropped = [a.name for a in self.adapters.values() if a.lora_id > self.num_static]
        for name in dropped:
            del self.adapters[name]
        dropped += [p.adapter.name for p in self.pending.values()]
        dropped += [p.adapter.name for p in self.held.values()]
        self.pending.clear()
        self.held.clear()
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
