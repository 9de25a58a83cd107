"""The scheduler process's side of LoRA adapters: loads and unloads asked for through the API,
the executor's answers, and the adapters a newly adopted executor comes with.

A load goes frontend ─▶ tokenizer worker ─▶ here ─▶ executor (AddLoraAdapter: read and
checked there) and its answer back the same way; the adapter's id is taken from then on
(`Scheduler.add_lora`). An unload refuses new requests at once; those admitted run to their end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.scheduler.engine_core import EngineCore
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.scheduler import Scheduler
from shared.protocol import (
    AddLoraAdapter,
    LoraAdapterAdded,
    LoraAdapterRequest,
    LoraAdapterResult,
    ParameterError,
    RequestError,
)

logger = logging.getLogger(__name__)
Answer = Callable[[bytes, LoraAdapterResult], None]  # (tokenizer worker, result)


class LoraControl:
    def __init__(self, registry: LoraRegistry, allow_updates: bool, answer: Answer) -> None:
        self.registry = registry
        self.allow_updates = allow_updates  # --allow-runtime-lora-updating
        self._answer = answer

    def adopt(self, scheduler: Scheduler, model_name: str) -> None:
        """The adapters of a newly adopted executor: those of --lora-modules, which it loaded
        at its start. Adapters loaded at run time are gone with the executor that took them."""
        self.registry.base_model = model_name
        for pending in self.registry.pending.values():
            error = RequestError.unavailable("the executor was replaced during the load")
            self.answer(pending.owner, pending.request_id, error)
        dropped = self.registry.drop_runtime_loads()
        if dropped:
            logger.warning("a new executor: LoRA adapters %s must be loaded again", dropped)
        for adapter in self.registry.listing():
            scheduler.add_lora(adapter.lora_id)

    def request(
        self,
        owner: bytes,
        request: LoraAdapterRequest,
        core: EngineCore | None,
        add_lora: Callable[[AddLoraAdapter], None],
    ) -> None:
        """Load (through the executor: `added` answers) or unload an adapter."""
        if core is None:
            error = RequestError.unavailable("the engine is still starting")
            self.answer(owner, request.request_id, error)
            return
        try:
            if not self.allow_updates:
                raise ParameterError("lora_name", "needs --allow-runtime-lora-updating")
            if request.action == "load":
                name, path = request.lora_name, request.lora_path
                lora_id = self.registry.begin_load(request.request_id, owner, name, path)
                add_lora(AddLoraAdapter(lora_id=lora_id, name=name, path=path or ""))
                return
            if request.action != "unload":
                raise ParameterError("action", f"{request.action!r} is not load or unload")
            adapter = self.registry.unload(request.lora_name)
            core.scheduler.remove_lora(adapter.lora_id)
            logger.info("LoRA adapter %r (id %d) unloaded", adapter.name, adapter.lora_id)
        except ParameterError as exc:  # NotFoundError too: an unknown name to unload
            self.answer(owner, request.request_id, RequestError.of(exc))
            return
        self.answer(owner, request.request_id, None)

    def added(self, message: LoraAdapterAdded, scheduler: Scheduler | None) -> None:
        """The executor's answer to a load: the adapter may be named from now on, or not."""
        pending = self.registry.finish_load(message.lora_id, message.error is None)
        if pending is None:
            return
        error = None
        if message.error is not None:
            error = RequestError.of(ParameterError("lora_path", message.error))
        elif scheduler is not None:
            scheduler.add_lora(message.lora_id)
            logger.info("LoRA adapter %r loaded as id %d", pending.adapter.name, message.lora_id)
        self.answer(pending.owner, pending.request_id, error)

    def answer(self, owner: bytes, request_id: str, error: RequestError | None) -> None:
        result = LoraAdapterResult(
            request_id=request_id,
            error=error,
            adapters=self.registry.listing(),
            version=self.registry.version,
        )
        self._answer(owner, result)
