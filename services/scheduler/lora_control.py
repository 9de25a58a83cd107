"""The scheduler process's side of LoRA adapters: loads and unloads asked for through the API,
the executor's answers, and the adapters a newly adopted executor comes with.

A tokenizer worker carries each load out on every engine replica (services/tokenizer/
lora_fanout.py): "load" has the executor read and check the adapter (AddLoraAdapter; `added`
answers) and hold it; "commit", once every replica holds it, lets requests name it
(`Scheduler.add_lora`); "discard" forgets a load that not every replica could take. An unload
refuses new requests at once; those admitted run to their end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.scheduler import Scheduler
from shared.protocol import (
    AddLoraAdapter,
    LoraAdapterAdded,
    LoraAdapterListing,
    LoraAdapterRequest,
    LoraAdapterResult,
    ParameterError,
    RequestError,
)

logger = logging.getLogger(__name__)
Answer = Callable[[bytes, LoraAdapterResult], None]  # (tokenizer worker, result)


class LoraControl:
    def __init__(
        self, registry: LoraRegistry, allow_updates: bool, replica: int, answer: Answer
    ) -> None:
        self.registry = registry
        self.allow_updates = allow_updates  # --allow-runtime-lora-updating
        self.replica = replica  # this scheduler's engine replica (--data-parallel-rank)
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
            # The other replicas, if any, still hold them: frontends name an adapter only
            # while every replica lists it, so requests for these get 404 until they are
            # unloaded and loaded again.
            logger.warning(
                "replica %d has a new executor: LoRA adapters %s are gone from it; unload "
                "them and load them again",
                self.replica,
                dropped,
            )
        for adapter in self.registry.listing():
            scheduler.add_lora(adapter.lora_id)

    def request(
        self,
        owner: bytes,
        request: LoraAdapterRequest,
        scheduler: Scheduler | None,
        add_lora: Callable[[AddLoraAdapter], None],
    ) -> None:
        """Load (through the executor: `added` answers), commit, discard or unload; None
        `scheduler`: the engine is starting."""
        if scheduler is None:
            starting = RequestError.unavailable("the engine is still starting")
            self.answer(owner, request.request_id, starting)
            return
        error: RequestError | None
        try:
            if not self.allow_updates:
                raise ParameterError("lora_name", "needs --allow-runtime-lora-updating")
            if request.action == "load":
                self._load(owner, request, add_lora)
                return
            error = self._change(request, scheduler)
        except ParameterError as exc:  # NotFoundError too: an unknown name to unload
            error = RequestError.of(exc)
        # An unload's answer says which ids were given before it (see LoraAdapterRequest).
        unload = request.action == "unload"
        self.answer(
            owner, request.request_id, error, self.registry.next_id if unload else request.lora_id
        )

    def _load(
        self, owner: bytes, request: LoraAdapterRequest, add_lora: Callable[[AddLoraAdapter], None]
    ) -> None:
        name, path = request.lora_name, request.lora_path
        lora_id = self.registry.begin_load(request.request_id, owner, name, path, request.lora_id)
        add_lora(AddLoraAdapter(lora_id=lora_id, name=name, path=path or ""))

    def _change(self, request: LoraAdapterRequest, scheduler: Scheduler) -> RequestError | None:
        """Unload, commit or discard: None, or why not. ParameterError for a bad request."""
        if request.action == "unload":
            self._unload(request.lora_name, request.lora_id, scheduler)
            return None
        if request.action == "commit":
            if request.lora_id is None:
                raise ParameterError("lora_id", "commit needs the load's id")
            return self._commit(request.lora_id, request.lora_name, scheduler)
        if request.action != "discard":
            raise ParameterError("action", f"{request.action!r} is not load or unload")
        discarded = self.registry.discard(request.lora_id, request.request_id)
        if discarded is not None:
            scheduler.remove_lora(discarded.lora_id)
            logger.info("LoRA adapter %r (id %d) discarded", discarded.name, discarded.lora_id)
        return None

    def _unload(self, name: str, below: int | None, scheduler: Scheduler) -> None:
        adapter, pending = self.registry.unload(name, below)
        scheduler.remove_lora(adapter.lora_id)
        logger.info("LoRA adapter %r (id %d) unloaded", adapter.name, adapter.lora_id)
        if pending is not None:  # its executor's answer will find nothing to finish
            error = RequestError.unavailable(f"{name!r} was unloaded while it loaded")
            self.answer(pending.owner, pending.request_id, error)

    def _commit(self, lora_id: int, name: str, scheduler: Scheduler) -> RequestError | None:
        committed = self.registry.commit(lora_id)
        if committed is None:
            return RequestError.unavailable(
                f"replica {self.replica} dropped the LoRA adapter {name!r} before it was named"
                " (unloaded meanwhile, or its executor was replaced)"
            )
        scheduler.add_lora(lora_id)
        logger.info("LoRA adapter %r loaded as id %d", name, lora_id)
        return None

    def added(self, message: LoraAdapterAdded) -> None:
        """The executor's answer to a load: the adapter is held (named on commit), or not."""
        pending = self.registry.finish_load(message.lora_id, message.error is None)
        if pending is None:
            return
        if message.error is not None:
            error = RequestError.of(ParameterError("lora_path", message.error))
            self.answer(pending.owner, pending.request_id, error)
        else:
            self.answer(pending.owner, pending.request_id, None, message.lora_id)

    def answer(
        self, owner: bytes, request_id: str, error: RequestError | None, lora_id: int | None = None
    ) -> None:
        listing = LoraAdapterListing(
            replica=self.replica, adapters=self.registry.listing(), version=self.registry.version
        )
        result = LoraAdapterResult(
            request_id=request_id, error=error, lora_id=lora_id, listings=[listing]
        )
        self._answer(owner, result)
