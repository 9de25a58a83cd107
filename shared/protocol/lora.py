"""Runtime LoRA adapter loads and unloads, between the frontend, the tokenizer workers, the
schedulers and their executors."""

from __future__ import annotations

from shared.protocol.base import Message, RequestError

# ---------------------------------------------------------------- LoRA adapters


class LoraAdapterInfo(Message, kw_only=True):
    """A LoRA adapter the server runs: requests name it as their `model`."""

    name: str
    lora_id: int  # >= 1, never reused while the schedulers run; the same on every replica
    path: str
    parent: str  # the base model it adapts, as /v1/models shows it


class LoraAdapterRequest(Message, tag=True, kw_only=True):
    """Load an adapter from `lora_path` under `lora_name`, or unload the adapter of that name
    (the API's /v1/load_lora_adapter and /v1/unload_lora_adapter). From a frontend to a
    tokenizer worker, which carries it out on every engine replica's scheduler in rounds
    (services/tokenizer/lora_fanout.py), with two more actions: "commit" (a load every replica
    holds may be named from now on) and "discard" (forget the load of `lora_id`)."""

    request_id: str
    action: str  # "load" | "unload"; to a scheduler also "commit" | "discard"
    lora_name: str
    lora_path: str | None = None  # for "load"
    # "load": the id to take the adapter under, given to every replica but the first, whose
    # scheduler names it (None). "commit", "discard": the load's. "unload" to every replica
    # but the first: the next id the first would give when it unloaded (its answer's
    # lora_id); an adapter of that name taken under that id or later is a newer load's, and
    # stays.
    lora_id: int | None = None


class LoraAdapterListing(Message, kw_only=True):
    """One engine replica's LoRA adapters, and when they last changed (see
    StatsSnapshot.lora_version)."""

    replica: int
    adapters: list[LoraAdapterInfo]
    version: int


class LoraAdapterResult(Message, tag=True, kw_only=True):
    """The answer to a LoraAdapterRequest: a scheduler's to a tokenizer worker, with its
    replica's adapters as they are now; the worker's to the frontend, with every replica's."""

    request_id: str
    error: RequestError | None = None
    lora_id: int | None = None  # the id a load took; from a scheduler, see the request's
    listings: list[LoraAdapterListing] = []


class AddLoraAdapter(Message, tag=True, kw_only=True):
    """The scheduler asks its executor to read and check an adapter and take it under an id."""

    lora_id: int
    name: str
    path: str


class LoraAdapterAdded(Message, tag=True, kw_only=True):
    """The executor's answer to AddLoraAdapter: None, or why the adapter cannot run."""

    lora_id: int
    error: str | None = None
